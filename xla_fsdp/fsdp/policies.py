"""FSDP2's policy objects: `MixedPrecisionPolicy`, `OffloadPolicy`, `CPUOffloadPolicy`.

The same names, fields and defaults as `torch.distributed.fsdp`'s, so a script may pass either ours or PyTorch's;
`as_mp_policy` / `as_offload_policy` read both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: the dtype parameters are gathered and computed in (None: their own); reduce_dtype: the dtype
    gradients are reduced in (None: param_dtype); output_dtype: the root's floating outputs are cast to it (None: left
    alone); cast_forward_inputs: each unit casts its floating inputs to param_dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Parameters, gradients and optimizer state live in host memory; each step moves the parameters to the chips and
    the gradients back, and the optimizer steps on the host. pin_memory: accepted for PyTorch's signature (XLA's host
    transfers do not use it)."""

    pin_memory: bool = True


def as_mp_policy(policy) -> MixedPrecisionPolicy:
    """Ours or `torch.distributed.fsdp.MixedPrecisionPolicy` -> ours."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if policy is None or not all(hasattr(policy, f) for f in fields):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (xla_fsdp.fsdp's or torch.distributed.fsdp's), "
                        f"got {type(policy).__name__}")
    return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in fields})


def as_offload_policy(policy) -> OffloadPolicy:
    """Ours or PyTorch's `OffloadPolicy` / `CPUOffloadPolicy` -> ours."""
    if isinstance(policy, OffloadPolicy):
        return policy
    name = type(policy).__name__
    if name == "CPUOffloadPolicy" and hasattr(policy, "pin_memory"):
        return CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise TypeError(f"offload_policy must be OffloadPolicy() or CPUOffloadPolicy() (xla_fsdp.fsdp's or "
                    f"torch.distributed.fsdp's), got {name}")
