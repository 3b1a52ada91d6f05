"""What `xla_fsdp.integrations.transformers.enable()` sets up beyond the four replaced functions.

- The single controller's runtime: under the single controller (`environment.runtime`) (launch/xla_spawn.py sets it,
  e.g. `--num_cores 4` on CPU) torch_xla's SPMD runtime is turned on (`xr.use_spmd()`) before any device use, so an
  unchanged Trainer script sees one process and the engine shards over the host's devices. Too late (tensors already on
  an XLA device without SPMD) is an error that names the fix.
- transformers' `is_tracing` is true inside the collective engine's per-device region
  ([Note: host reads in the manual region] in collective_engine/host_reads.py): its mask code then builds the causal
  (and padding) mask from the attention mask without reading its values.
- transformers 5.23's default optimizer, `adamw_torch_fused`, has no XLA kernel: on an XLA device the Trainer gets
  `torch.optim.AdamW` unfused (the same update), with a warning.
- `num_items_in_batch` (the global count of label tokens the Trainer passes to models whose loss sums over tokens) is
  divided by the devices the batch is split over: each device's loss is then its sum over the global count times D, and
  the region's mean over devices is the global loss."""
from __future__ import annotations

import logging
from typing import Callable

from ..runtime import environment
from ..runtime.environment import RUNTIME as RUNTIME_ENV
from ..runtime.environment import SINGLE_CONTROLLER

logger = logging.getLogger("xla_fsdp.integrations.transformers")

# transformers' is_tracing steered inside the region: the collective engine's, which scan_layers uses too
from ..collective_engine.manual_region import steer_is_tracing  # noqa: E402,F401


def set_up_runtime() -> None:
    """Turn on torch_xla's SPMD runtime when the launcher chose the single controller."""
    if environment.runtime() != SINGLE_CONTROLLER:
        return
    import torch_xla
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return
    if torch_xla._XLAC._xla_get_spmd_config_is_locked():
        raise RuntimeError(
            f"{RUNTIME_ENV}={SINGLE_CONTROLLER} (set by launch/xla_spawn.py) runs this process as the single "
            "controller of every device, which needs torch_xla's SPMD runtime, but tensors were already put on "
            "an XLA device without it, so the Trainer would see one replica per device and wait for the others. "
            "Call xla_fsdp.integrations.transformers.enable() (or torch_xla.runtime.use_spmd()) at the top of "
            "the script, before any model or tensor is moved to the XLA device")
    xr.use_spmd()


def unfused_adamw(get_optimizer_cls_and_kwargs: Callable) -> Callable:
    """`Trainer.get_optimizer_cls_and_kwargs` that drops `fused=True` on XLA devices."""

    def get(args, model=None):
        cls, kwargs = get_optimizer_cls_and_kwargs(args, model)
        if kwargs.get("fused") and getattr(args.device, "type", None) == "xla":
            logger.warning("xla_fsdp: --optim %s (transformers' default) has no XLA kernel; training with "
                           "torch.optim.AdamW unfused (the same update). Pass --optim adamw_torch to say so.",
                           getattr(args.optim, "value", args.optim))
            kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
        return cls, kwargs

    return staticmethod(get)


def batch_split(model) -> int:
    """How many devices the collective engine splits each batch over in this process (1 unless the single controller
    runs it)."""
    from ..unit_state import state_of

    state = state_of(model)
    comm = state.group.comm if state is not None else None
    if comm is None or not getattr(comm, "is_single_controller", False):
        return 1
    return comm.placement.num_devices
