"""Hugging Face's Adafactor on stored stacks, one layer at a time as without scan.

[Note: Adafactor on stored stacks]
Adafactor keeps statistics over a whole tensor: the row and column factors of
its second moment average over the last two dims, the update is clipped by
its RMS, and with `scale_parameter` the step scales with the parameter's RMS.
A stored stack (d0, L, *rest) holds L layers' parameters in one tensor
([Note: parameters stored stacked]); run as it is, every one of those would
mix the layers. The recipe trains with `--optim adafactor`, so instead of
refusing it, the optimizer-step pre-hook of stored_stacks.py runs Adafactor's
update on each stack itself, with the layers as a batch dim: every statistic is
taken per layer, and each layer gets the update Hugging Face's Adafactor
gives that layer's parameter without scan (to rounding). The stacks' gradients
are then hidden from Adafactor's own step, which updates the other
parameters, and put back after it.

The state keeps Adafactor's keys, laid out so that checkpoints treat it as
they treat any state (checkpoint/holdings.py):
- `exp_avg`, `exp_avg_sq` (the stack's shape) and `exp_avg_sq_row`
  (d0, L, *rest[:-1]) keep the parameter's rows on dim 0 and the layers on
  dim 1, as the stack does: they shard, pad and split per layer as rows.
- `exp_avg_sq_col` (L, *col) and `RMS` (L,) are per layer, the layers on
  dim 0: what Adafactor computes over a whole parameter (or, one process per
  chip, over a shard), saved whole.
- `step` is Adafactor's integer count.

Only `transformers.optimization.Adafactor` itself is run this way (not a
subclass, whose step may differ; torch.optim.Adafactor's rule differs), and
without a closure (the gradients must exist when the hook runs).
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch

KIND = "transformers.optimization.Adafactor"
LAYERS_FIRST = ("exp_avg_sq_col", "RMS")  # state a stack keeps per layer on dim 0 (the others: dim 1)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _layers_first(t: torch.Tensor, per_layer_dims: int) -> torch.Tensor:
  """A stored-layout tensor (d0, L, *rest) as (L, d0, *rest); a stored 0-dim stack (L,) as it is."""
  return t.movedim(1, 0) if per_layer_dims else t


def _stored(t: torch.Tensor, per_layer_dims: int) -> torch.Tensor:
  return t.movedim(0, 1) if per_layer_dims else t


def _per_layer(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
  """(L,) values broadcast against a layers-first tensor."""
  return v.reshape(v.shape + (1,) * (like.dim() - 1))


def _rms(t: torch.Tensor) -> torch.Tensor:
  """Adafactor's RMS of each layer of a layers-first tensor: (L,)."""
  flat = t.reshape(t.shape[0], -1)
  return flat.norm(2, dim=1) / (flat.shape[1] ** 0.5)


def _lr(group: dict, step: int, rms: torch.Tensor):
  """Adafactor's step size (`Adafactor._get_lr`): a float, or (L,) with `scale_parameter`."""
  rel = group["lr"]
  if group["relative_step"]:
    least = 1e-6 * step if group["warmup_init"] else 1e-2
    rel = min(least, 1.0 / math.sqrt(step))
  if group["scale_parameter"]:
    return torch.clamp(rms, min=group["eps"][1]) * rel
  return rel


def _approx_sq_grad(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
  r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
  return torch.mul(r_factor, col.unsqueeze(-2).rsqrt())


def _init_state(state: dict, grad: torch.Tensor, layers: int, per_layer: Tuple[int, ...], factored: bool,
                first_moment: bool) -> None:
  if len(state) == 0:
    state["step"] = 0
    if first_moment:
      state["exp_avg"] = torch.zeros_like(grad)
    if factored:
      state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1]).to(grad)
      state["exp_avg_sq_col"] = torch.zeros((layers,) + per_layer[:-2] + per_layer[-1:]).to(grad)
    else:
      state["exp_avg_sq"] = torch.zeros_like(grad)
    state["RMS"] = 0
    return
  for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
    if key in state:
      state[key] = state[key].to(grad)


def _moment(stored: torch.Tensor, per_layer_dims: int, beta: float, value: torch.Tensor) -> torch.Tensor:
  """stored <- beta * stored + (1 - beta) * value (value layers-first); returns the new value
  layers-first."""
  new = _layers_first(stored, per_layer_dims).mul(beta).add_(value, alpha=1.0 - beta)
  stored.copy_(_stored(new, per_layer_dims))
  return new


@torch.no_grad()
def update_stack(optimizer, group: dict, p: torch.Tensor) -> None:
  """Adafactor's step for stored stack `p` (its gradient set), per layer (see the note)."""
  grad = p.grad
  if grad.is_sparse:
    raise RuntimeError("Adafactor does not support sparse gradients.")
  if grad.dtype in LOW_PRECISION:
    grad = grad.float()
  dims = p.dim() - 1  # a layer's own dims; a stored (L,) holds 0-dim parameters
  g = _layers_first(grad, dims)
  layers, per_layer = g.shape[0], tuple(g.shape[1:])
  factored = len(per_layer) >= 2
  first_moment = group["beta1"] is not None
  state = optimizer.state[p]
  _init_state(state, grad, layers, per_layer, factored, first_moment)

  p32 = p.float() if p.dtype in LOW_PRECISION else p
  weights = _layers_first(p32, dims)
  state["step"] += 1
  rms = _rms(weights)
  state["RMS"] = rms
  lr = _lr(group, state["step"], rms)
  if isinstance(lr, torch.Tensor):
    lr = _per_layer(lr, weights)
  beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])

  update = (g ** 2) + group["eps"][0]
  if factored:
    row = _moment(state["exp_avg_sq_row"], dims, beta2t, update.mean(dim=-1))
    col = state["exp_avg_sq_col"].mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
    update = _approx_sq_grad(row, col).mul_(g)
  else:
    update = _moment(state["exp_avg_sq"], dims, beta2t, update).rsqrt().mul_(g)
  update.div_(_per_layer((_rms(update) / group["clip_threshold"]).clamp_(min=1.0), update))
  update.mul_(lr)
  if first_moment:
    update = _moment(state["exp_avg"], dims, group["beta1"], update)
  new = weights
  if group["weight_decay"] != 0:
    new = new.add(new * (-group["weight_decay"] * lr))
  new = new.add(-update)
  p.copy_(_stored(new, dims))


def step_stacks(optimizer) -> List[Tuple[torch.Tensor, torch.Tensor]]:
  """Runs the update of every stored stack with a gradient and hides that gradient from
  Adafactor's own step; returns (stack, gradient) to put back after it."""
  hidden = []
  for group in optimizer.param_groups:
    for p in group["params"]:
      if getattr(p, "_xla_fsdp_stacked", False) and p.grad is not None:
        update_stack(optimizer, group, p)
        hidden.append((p, p.grad))
        p.grad = None
  return hidden
