"""Gradient-norm clipping across the shards of every unit.

Each rank (or device, in the single-controller runtime) sums |g|^p over its own shards (padding rows hold zero
gradients), the sums are all-reduced over the shard group only (replicas hold the same shards and must not be counted
twice), and every shard is scaled by the factor `torch.nn.utils.clip_grad_norm_` would use on the unsharded model.

[Note: units with different layouts] Nested units may shard differently (e.g. a NO_SHARD unit inside a FULL_SHARD root:
its gradients are whole on every rank). Summing every gradient over the root's shard group would count such a unit's
gradients once per rank, a wrong norm and no error. So the gradients are grouped by the layout of the unit that owns
them, each group's partial sum is reduced over its own shard group, and the groups' totals are added (or maxed), in the
same order on every rank.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn as nn

from ..unit_state import state_of, units
from .collectives import REDUCE_MAX, REDUCE_SUM


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
    state = state_of(root)
    if state is None:
        raise ValueError("clip_grad_norm_ must be called on a module wrapped by XlaFullyShardedDataParallel")
    if state.is_root is False:
        raise ValueError("call clip_grad_norm_ on the root unit (the outermost wrapped module), not on a nested unit")
    comm = state.group.comm
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    grads = [p.grad for p in root.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=comm.device)
    by_layout = _grads_by_layout(root, comm)
    if groups is not None and len(by_layout) > 1:
        raise ValueError("clip_grad_norm_(groups=...) sums every gradient over the given rank groups, but the "
                         "units below this root shard differently (sharding_strategy or sharding_groups differ "
                         "between nested units); give every unit the same layout, or drop groups=")
    partials = []
    for unit_comm, unit_grads in by_layout.items():
        # this device's pieces (single-controller runtime: the gradients are global tensors)
        local_grads = [unit_comm.local_view(g, "param", grad=False) for g in unit_grads]
        local = (torch.stack([g.abs().max().float() for g in local_grads]).max() if inf else
                 torch.stack([g.float().norm(norm_type) ** norm_type for g in local_grads]).sum())
        partials.append(unit_comm.all_reduce(local.reshape(1), _norm_group(unit_comm, groups),
                                             REDUCE_MAX if inf else REDUCE_SUM))
    # elementwise on the (1,)-shaped partials: under the single-controller runtime a stack or a reduction over them
    # makes the partitioner gather them
    total = partials[0]
    for part in partials[1:]:
        total = torch.maximum(total, part) if inf else total + part
    if not inf:
        total = total ** (1.0 / norm_type)
    total = comm.global_value(total).reshape(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


def _grads_by_layout(root: nn.Module, root_comm) -> "OrderedDict":
    """Gradients (in `root.parameters()` order, the same on every rank) grouped by the sharding
    layout of the unit that owns them, keyed by one of those units' `Collectives`."""
    owner = {id(fp.sharded): unit.group.comm for unit in map(state_of, units(root)) for fp in unit.group.params}
    comm_for: dict = {}
    out: "OrderedDict" = OrderedDict()
    for p in (p for p in root.parameters() if p.grad is not None):
        c = owner.get(id(p), root_comm)
        c = comm_for.setdefault((type(c), c.layout.shard_groups, c.layout.replicate_groups), c)
        out.setdefault(c, []).append(p.grad)
    return out


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
