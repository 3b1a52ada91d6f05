"""What a checkpointed forward saw, for its recomputation in backward to see it again.

[Note: what a recomputation sees] A checkpointed forward runs twice: without autograd in forward, and again in
backward to rebuild its activations. The second run must compute exactly what the first computed, and leave behind
nothing the first did not (issue 41: a conv + BatchNorm model drifted from its run without checkpointing):
- random numbers: the host's generator and, on XLA, the device's are set to their state at the forward (dropout draws
  the same mask), and put back after;
- autocast: backward usually runs outside the caller's `torch.autocast` region, so the forward's autocast settings (cpu
  and xla) are entered again (else a bf16-autocast forward is recomputed in fp32);
- buffers: a forward may update buffers in place (BatchNorm's running statistics, num_batches_tracked). The
  recomputation must neither update them a second time nor read the updated values, so every buffer of the module is
  copied right before the forward and the recomputation runs with a fresh copy in the buffer's place, dropped after.
  Every buffer, not only those the forward changed: BatchNorm's kernel updates the running statistics without moving
  their version counters. On XLA a copy is a new name for the same traced value (no copy op, no device memory); on the
  host it is a real copy (buffers are small next to the activations a checkpoint drops). It also gives the
  recomputation the buffers the forward saw where the module's differ at backward time: under the single controller,
  the per-device copies the manual region swaps in only around the root's forward.
Parameters need no snapshot: no optimizer step runs between a forward and its backward, so the recomputation gathers
the same shards again."""
from __future__ import annotations

import contextlib
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

_AUTOCAST_DEVICES = ("cpu", "xla")


def _rng_state(on_xla: bool) -> Tuple[torch.Tensor, Any]:
    xla_state = None
    if on_xla:
        import torch_xla.core.xla_model as xm

        xla_state = xm.get_rng_state()
    return torch.get_rng_state(), xla_state


def _set_rng_state(state) -> None:
    cpu, xla_state = state
    torch.set_rng_state(cpu)
    if xla_state is not None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(xla_state)


def _autocast_state() -> List[Tuple[str, bool, torch.dtype]]:
    return [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in _AUTOCAST_DEVICES]


class ForwardState:
    """Taken right before a checkpointed forward of `module` (under no_grad); `replayed()` around its recomputation. See
    [Note: what a recomputation sees]."""

    def __init__(self, module: Optional[nn.Module], on_xla: bool):
        self.on_xla = on_xla
        self.rng = _rng_state(on_xla)
        self.autocast = _autocast_state()
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.buffers = [(m, name, b.clone()) for m in (module.modules() if module is not None else ())
                        for name, b in m._buffers.items() if b is not None]

    @contextlib.contextmanager
    def replayed(self):
        """The forward's random state, autocast settings and buffers, for the length of the block."""
        current_rng = _rng_state(self.on_xla)
        _set_rng_state(self.rng)
        installed = []
        for m, name, before in self.buffers:
            installed.append((m, name, m._buffers.get(name)))
            m._buffers[name] = before.clone()  # a second backward (retain_graph) starts from it again
        try:
            with contextlib.ExitStack() as stack:
                for dev, enabled, dtype in self.autocast:
                    if (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) != (enabled, dtype):
                        stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled,
                                                           cache_enabled=self.autocast_cache))
                yield
        finally:
            for m, name, tensor in installed:
                m._buffers[name] = tensor
            _set_rng_state(current_rng)
