"""XLA's optimization barrier, the one way xla_fsdp orders work the compiler could otherwise move: every value that
passes through one barrier together is computed before any of them is read after it."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

if TYPE_CHECKING:
    import torch


def optimization_barrier(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """`tensors` through one barrier, as new tensors (the barrier replaces its operands' values in place; the caller's
    tensors stay); tensors off XLA pass unchanged."""
    tensors = list(tensors)
    if not tensors or tensors[0].device.type != "xla":
        return tensors
    import torch_xla

    out = [t.clone() for t in tensors]
    torch_xla._XLAC._xla_optimization_barrier_(out)
    return out
