"""Gradient-norm clipping across the shards of every unit.

Each rank (or device, in the single-controller runtime) sums |g|^p over its own shards (padding rows hold zero gradients),
the sums are all-reduced over the shard group only (replicas hold the same
shards and must not be counted twice), and every shard is scaled by the
factor `torch.nn.utils.clip_grad_norm_` would use on the unsharded model.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .collectives import REDUCE_MAX, REDUCE_SUM


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
    state = getattr(root, "_fsdp_state", None)
    if state is None:
        raise ValueError("clip_grad_norm_ must be called on a module wrapped by XlaFullyShardedDataParallel")
    if state.is_root is False:
        raise ValueError("call clip_grad_norm_ on the root unit (the outermost wrapped module), not on a nested unit")
    comm = state.group.comm
    norm_type = float(norm_type)
    grads = [p.grad for p in root.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=comm.device)
    # this device's pieces (single-controller runtime: the gradients are global tensors)
    local_grads = [comm.local_view(g, "param", grad=False) for g in grads]
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max().float() for g in local_grads]).max()
        total = comm.all_reduce(local.reshape(1), _norm_group(comm, groups), REDUCE_MAX)
    else:
        local = torch.stack([g.float().norm(norm_type) ** norm_type for g in local_grads]).sum()
        total = comm.all_reduce(local.reshape(1), _norm_group(comm, groups), REDUCE_SUM) ** (1.0 / norm_type)
    total = comm.global_value(total).reshape(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


def _norm_group(comm, groups):
    """The group the partial norms are summed over: the sharding group, or torch_xla's `groups`."""
    if groups is None:
        return "shard"
    groups = tuple(tuple(int(r) for r in g) for g in groups)
    if comm.is_single_controller:
        raise ValueError("clip_grad_norm_(groups=...) is for one process per device (FSDP mixed with model "
                         "parallelism); the single-controller runtime sums over its sharding groups itself")
    if not any(comm.layout.rank in g for g in groups):
        raise ValueError(f"clip_grad_norm_(groups={[list(g) for g in groups]}): no group contains this rank "
                         f"({comm.layout.rank})")
    return groups
