"""Hugging Face's Adafactor on stored stacks, one layer at a time as without scan.

[Note: Adafactor on stored stacks]
Adafactor keeps statistics over a whole tensor: the row and column factors of its second moment average over the last
two dims, the update is clipped by its RMS, and with `scale_parameter` the step scales with the parameter's RMS. A
stored stack (d0, L, *rest) holds L layers' parameters in one tensor ([Note: parameters stored stacked]); run as it is,
every one of those would mix the layers. The recipe trains with `--optim adafactor`, so instead of refusing it, the
optimizer-step pre-hook of stored_stacks.py runs Adafactor's update on each stack itself, in the stack's own layout:
every statistic is reduced over all dims but the layers' (a layer's dim k is the stack's dim k, or k + 1 past dim 0), so
each layer gets the update Hugging Face's Adafactor gives that layer's parameter without scan (to rounding). Nothing is
transposed but a >2-dim layer's small column factor. The stacks' gradients are then hidden from Adafactor's own step,
which updates the other parameters, and put back after it.

The state keeps Adafactor's keys, laid out so that checkpoints treat it as any state (checkpoint/holdings.py):
- `exp_avg`, `exp_avg_sq` (the stack's shape) and `exp_avg_sq_row` (d0, L, *rest[:-1]) keep the parameter's rows on dim
  0 and the layers on dim 1, as the stack does: they shard, pad and split per layer as rows.
- `exp_avg_sq_col` (L, *col) and `RMS` (L,) are per layer, the layers on dim 0: what Adafactor computes over a whole
  parameter (or, one process per chip, over a shard), saved whole.
- `step` is Adafactor's integer count.

Only `transformers.optimization.Adafactor` itself is run this way (not a subclass, whose step may differ;
torch.optim.Adafactor's rule differs), and without a closure (the gradients must exist when the hook runs).
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch

KIND = "transformers.optimization.Adafactor"
LAYERS_FIRST = ("exp_avg_sq_col", "RMS")  # state a stack keeps per layer on dim 0 (the others: dim 1)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _rms(t: torch.Tensor, layer_dim: int) -> torch.Tensor:
    """Adafactor's RMS of each layer of stored-layout `t`, broadcastable against it."""
    dims = [d for d in range(t.dim()) if d != layer_dim]
    if not dims:  # (L,): each layer's RMS is its value's magnitude
        return t.abs()
    return torch.linalg.vector_norm(t, 2, dim=dims, keepdim=True) / ((t.numel() // t.shape[layer_dim]) ** 0.5)


def _lr(group: dict, step: int, rms: torch.Tensor):
    """Adafactor's step size (`Adafactor._get_lr`): a float, or per layer with `scale_parameter`."""
    rel = group["lr"]
    if group["relative_step"]:
        least = 1e-6 * step if group["warmup_init"] else 1e-2
        rel = min(least, 1.0 / math.sqrt(step))
    if group["scale_parameter"]:
        return torch.clamp(rms, min=group["eps"][1]) * rel
    return rel


def _stored_dim(k: int) -> int:
    """A layer's dim k in the stored (d0, L, *rest)."""
    return 0 if k == 0 else k + 1


def _col_swap(col: torch.Tensor, dims: int) -> torch.Tensor:
    """The column factor between its kept layout (L, *col) and the stack's (the layers on dim 1 when it keeps rows):
    both ways, dims 0 and 1 swapped."""
    return col if dims == 2 else col.movedim(0, 1)


def _init_state(state: dict, grad: torch.Tensor, dims: int, factored: bool, first_moment: bool) -> None:
    if len(state) == 0:
        state["step"] = 0
        if first_moment:
            state["exp_avg"] = torch.zeros_like(grad)
        if factored:  # made on the gradient's device: a host tensor moved there is one copy per device
            # (the check's 405B trace held 0.3 GB of host memory per layer so, and was killed at 126 layers)
            state["exp_avg_sq_row"] = grad.new_zeros(grad.shape[:-1])
            col = list(grad.shape)
            del col[_stored_dim(dims - 2)]
            state["exp_avg_sq_col"] = _col_swap(grad.new_zeros(col), dims).contiguous()
        else:
            state["exp_avg_sq"] = torch.zeros_like(grad)
        state["RMS"] = 0
        return
    for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
        if key in state:
            state[key] = state[key].to(grad)


@torch.no_grad()
def update_stack(optimizer, group: dict, p: torch.Tensor) -> None:
    """Adafactor's step for stored stack `p` (its gradient set), per layer (see the note). It runs on the stored
    layout: a layer's reductions are over every dim but the layers'."""
    grad = p.grad
    if grad.is_sparse:
        raise RuntimeError("Adafactor does not support sparse gradients.")
    if grad.dtype in LOW_PRECISION:
        grad = grad.float()
    dims = p.dim() - 1  # a layer's own dims; a stored (L,) holds 0-dim parameters
    layer_dim = 1 if dims else 0
    factored = dims >= 2
    first_moment = group["beta1"] is not None
    state = optimizer.state[p]
    _init_state(state, grad, dims, factored, first_moment)

    p32 = p.float() if p.dtype in LOW_PRECISION else p
    state["step"] += 1
    rms = _rms(p32, layer_dim)
    state["RMS"] = rms.reshape(-1)
    lr = _lr(group, state["step"], rms)
    beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])

    update = (grad**2) + group["eps"][0]
    if factored:
        across = _stored_dim(dims - 2)  # the dim a layer's column factor averages away
        row = state["exp_avg_sq_row"].mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
        col = _col_swap(state["exp_avg_sq_col"], dims).mul(beta2t).add_(update.mean(dim=across), alpha=1.0 - beta2t)
        state["exp_avg_sq_col"].copy_(_col_swap(col, dims))
        r_factor = (row / row.mean(dim=across, keepdim=True)).rsqrt_().unsqueeze(-1)
        update = torch.mul(r_factor, col.unsqueeze(across).rsqrt()).mul_(grad)
    else:
        update = state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t).rsqrt().mul_(grad)
    update.div_((_rms(update, layer_dim) / group["clip_threshold"]).clamp_(min=1.0))
    update.mul_(lr)
    if first_moment:
        update = state["exp_avg"].mul_(group["beta1"]).add_(update, alpha=1.0 - group["beta1"])
    if group["weight_decay"] != 0:
        if isinstance(lr, torch.Tensor):
            p32.add_(p32 * (-group["weight_decay"] * lr))
        else:
            p32.add_(p32, alpha=-group["weight_decay"] * lr)
    p32.add_(-update)
    if p.dtype in LOW_PRECISION:
        p.copy_(p32)


def step_stacks(optimizer) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Runs the update of every stored stack with a gradient and hides that gradient from Adafactor's own step; returns
    (stack, gradient) to put back after it."""
    hidden = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_xla_fsdp_stacked", False) and p.grad is not None:
                update_stack(optimizer, group, p)
                hidden.append((p, p.grad))
                p.grad = None
    return hidden
