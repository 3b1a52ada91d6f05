"""Compute dtypes across nested units: where each unit casts its inputs, and the nesting that
leaves weights and inputs in different precisions.

[Note: every unit casts its own inputs]
A unit with a compute dtype casts the floating tensors it is called with to that dtype, root or not, as torch_xla's
XlaFullyShardedDataParallel (`forward`) and FSDP2's `cast_forward_inputs` do. Code written for torch_xla's FSDP nests
bf16 units inside an fp32 root (only the transformer blocks in bf16); their inputs then arrive in fp32 and must be cast
where they enter the unit, or its bf16 weights meet fp32 activations. A cast of a tensor that already has the dtype is
no operation, so units of one dtype record the same program as a cast at the root alone.

The opposite nesting, a unit computing in fp32 (no compute dtype) inside one that computes in bf16, gets bf16 inputs and
has fp32 weights: torch_xla records the mixed matmul, XLA:CPU refuses it at compile ("mixed precision is disallowed")
and a TPU runs it in mixed precision. torch_xla's FSDP does the same, so it is kept, with a warning at wrap time that
names the units and the fix.
"""
from __future__ import annotations

import warnings
from typing import List

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..class_swap import original_class
from ..options import MixedPrecision
from ..unit_state import state_of


class MixedPrecisionNestingWarning(UserWarning):
    """A unit computing in fp32 sits inside one that computes in lower precision."""


def cast_inputs(mixed_precision: MixedPrecision, args, kwargs):
    """`args`, `kwargs` with every floating tensor in the unit's compute dtype."""
    dtype = mixed_precision.compute_dtype

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(cast, args), tree_map(cast, kwargs)


def warn_full_precision_units_inside(module: nn.Module, mixed_precision: MixedPrecision) -> None:
    """Warn when `module`, about to become a unit computing in `mixed_precision`'s dtype, holds
    units that compute in fp32 and own floating parameters ([Note: every unit casts its own inputs])."""
    if not mixed_precision.enabled:
        return
    inside: List[str] = []
    stack = [(n, c) for n, c in module.named_children()]
    while stack:  # the units called from this one's own compute: not below another unit
        name, m = stack.pop(0)
        state = state_of(m)
        if state is None:
            stack.extend((f"{name}.{n}", c) for n, c in m.named_children())
        elif not state.options.mixed_precision.enabled and any(p.orig_dtype.is_floating_point
                                                                for p in state.group.params):
            inside.append(name)
    if inside:
        dtype = str(mixed_precision.compute_dtype).replace("torch.", "")
        shown = ", ".join(repr(n) for n in inside[:4]) + (f" and {len(inside) - 4} more" if len(inside) > 4 else "")
        outer = original_class(module).__name__
        warnings.warn(
            f"unit(s) {shown} inside {outer} compute in float32 while {outer} computes in {dtype}: "
            f"their inputs arrive in {dtype} and meet float32 weights (XLA:CPU refuses the mixed matmul at "
            f"compile, 'mixed precision is disallowed'; a TPU computes it in mixed precision). Give those units "
            f"the same compute_dtype (or mixed_precision), or wrap with auto_wrap_policy, which passes the "
            f"outer unit's settings on. torch_xla's FSDP behaves the same.",
            MixedPrecisionNestingWarning, stacklevel=4)
