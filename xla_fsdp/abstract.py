"""Abstract device tensors: shapes without buffers, for tracing a step that never runs.

[Note: abstract tracing] The ahead-of-time check (`python -m xla_fsdp.aot`) traces one training step of a job at a
TPU slice's device count on this host and hands the program to libtpu's compiler. Nothing runs, so no value matters,
and a 20B model must not need 80 GB of host memory to be checked. While the check's settings (`environment.AOT`) say
`trace` (in the process it traces):
- units built on the meta device or with `deferred_init` are not materialized (no constructor replay, no
  `reset_parameters()`);
- every tensor an engine would move to the device from the meta device becomes a torch_xla placeholder of the same
  shape and dtype (a device tensor with no buffer), carrying the sharding the real tensor would carry.
The traced program is the same as a real run's: placeholders enter it as parameters exactly where device data would.
Reading a placeholder's value aborts the process, so code that reads values (logging, checkpoints) must not run under
the trace; `active()` tells it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from xla_fsdp.runtime import environment

if TYPE_CHECKING:  # torch loads where a tensor is made: `python -m xla_fsdp.aot` reads the settings without it
    import torch


def active() -> bool:
    """Whether this process traces for the ahead-of-time check (see the note above)."""
    return bool(environment.aot().get("trace"))


def tpu_target() -> bool:
    """True on a TPU, or while this process traces for the check (which compiles for one)."""
    if active():
        return True
    try:
        import torch_xla.runtime as xr

        return xr.device_type() == "TPU"
    except Exception:  # no runtime: no TPU
        return False


def placeholder(shape, dtype: torch.dtype, sharding=None) -> torch.Tensor:
    """A device tensor of `shape` / `dtype` with no buffer; `sharding`: a torch_xla OpSharding."""
    import torch_xla
    from torch_xla.core import xla_builder as xb

    out = xb.create_placeholder_tensor(tuple(shape), dtype)
    if sharding is not None:
        # mark_sharding refuses a tensor without data; this annotates the placeholder's parameter instead, which is what
        # a sharded input looks like to the compiler
        torch_xla._XLAC._xla_annotate_custom_sharding(out, sharding)
    return out


def to_device(tensor: torch.Tensor, device, sharding=None) -> torch.Tensor:
    """`tensor` on the XLA `device`; under the trace, a meta tensor becomes a placeholder."""
    if active() and tensor.is_meta:
        import torch

        return placeholder(torch.Tensor.size(tensor), tensor.dtype, sharding)  # stored shape
    return tensor.to(device)


def skip_materialization(tensors) -> bool:
    """Under the trace, meta tensors stay meta until they are placed (no initialization)."""
    return active() and any(t.is_meta for t in tensors)
