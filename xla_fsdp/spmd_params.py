"""Compute-dtype casting for the SPMD engine: fp32 master weights, low-precision math.

[Note: casting sharded parameters]
Each module that owns parameters swaps them, for the length of its own
forward, for `param.to(compute_dtype)`. The cast is differentiable, so the
gradient lands on the fp32 Parameter in fp32, and because the cast is applied
to the dim-0 sharded parameter the partitioner gathers the low-precision copy
(half the bytes). The swap writes `module._parameters[name]` directly, the
same trick PyTorch FSDP2 uses, because `setattr` refuses a non-Parameter.
The swap is per module owning the tensor, not per unit, so that a
checkpointed unit recomputes with the same casts in backward.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle


class ComputeCast:
  """Swaps a module's own parameters for compute-dtype copies during forward."""

  def __init__(self, module: nn.Module, dtype: torch.dtype):
    self.module = module
    self.dtype = dtype
    self.masters: Dict[str, nn.Parameter] = {}

  def enter(self) -> None:
    if self.masters:  # re-entered (e.g. recursion); already cast
      return
    for name, param in list(self.module._parameters.items()):
      if param is None or not param.is_floating_point():
        continue
      self.masters[name] = param
      self.module._parameters[name] = param.to(self.dtype)

  def exit(self) -> None:
    for name, param in self.masters.items():
      self.module._parameters[name] = param
    self.masters = {}


def cast_floating(tree, dtype: torch.dtype):
  """Casts every floating tensor in a (possibly nested) args structure."""
  if isinstance(tree, torch.Tensor):
    return tree.to(dtype) if tree.is_floating_point() else tree
  if isinstance(tree, tuple):
    return tuple(cast_floating(t, dtype) for t in tree)
  if isinstance(tree, list):
    return [cast_floating(t, dtype) for t in tree]
  if isinstance(tree, dict):
    return {k: cast_floating(v, dtype) for k, v in tree.items()}
  return tree


def install_compute_dtype(
    root: nn.Module, dtype: torch.dtype
) -> Tuple[List[RemovableHandle], Dict[nn.Module, ComputeCast]]:
  """Casts parameters of every module under `root`, and root's float inputs.

  Returns the hook handles and the per-module casts (the checkpoint wrapper
  re-enters a unit's own cast during recompute, which runs outside hooks).
  """
  handles: List[RemovableHandle] = []
  casts: Dict[nn.Module, ComputeCast] = {}
  for module in root.modules():
    if not any(p is not None for p in module._parameters.values()):
      continue
    cast = ComputeCast(module, dtype)
    casts[module] = cast
    handles.append(
        module.register_forward_pre_hook(lambda m, args, c=cast: c.enter()))
    # always_call: a forward that raises must still put the masters back.
    handles.append(
        module.register_forward_hook(
            lambda m, args, out, c=cast: c.exit(), always_call=True))

  def cast_inputs(module: nn.Module, args: Tuple, kwargs: Dict):
    return cast_floating(args, dtype), cast_floating(kwargs, dtype)

  handles.append(
      root.register_forward_pre_hook(
          cast_inputs, with_kwargs=True, prepend=True))
  return handles, casts
