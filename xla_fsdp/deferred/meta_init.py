"""Giving meta-device modules storage: `to_empty` then the module's own `reset_parameters()`.

What PyTorch's FSDP (both versions) and torch_xla's do for a model built under `torch.device("meta")` when no
`param_init_fn` is given. Every module is checked before any is touched: one without `reset_parameters()` is an error
naming it, and the unit stays on the meta device. Parameters tied across modules stay tied (`to_empty` alone would give
each module its own copy). Values are drawn from the global RNG, unit by unit: statistically what the eager constructor
gives, not bit-equal to it (`xla_fsdp.deferred_init` replays the constructor exactly)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn as nn


def _own_tensors(module: nn.Module) -> List[torch.Tensor]:
    return [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]


def reset_meta_modules(modules: Iterable[Tuple[str, nn.Module]], unit_name: str) -> None:
    """Materialize every module in `modules` ((name, module) pairs) that holds meta tensors."""
    pending = [(name, m) for name, m in modules if any(t.is_meta for t in _own_tensors(m))]
    missing = [f"{name or '(the unit itself)'} ({type(m).__name__})" for name, m in pending
               if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise ValueError(
            f"{unit_name} is on the meta device and these modules have no reset_parameters() to "
            f"initialize them: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Build the model "
            "with xla_fsdp.deferred_init(...) (replays its constructor), or pass param_init_fn= to "
            "materialize each unit")
    sites: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for _, m in pending:
        for pname, p in m._parameters.items():
            if p is not None:
                sites.setdefault(id(p), []).append((m, pname))
    for _, m in pending:
        m.to_empty(device="cpu", recurse=False)
    # in eager construction a tie is made after both modules initialized: the first owner's values win
    first_site: Dict[int, List[str]] = {}
    for (owner, name), *others in sites.values():  # re-tie: one new tensor for every site of a tied parameter
        for m, pname in others:
            m._parameters[pname] = owner._parameters[name]
        if others:
            first_site.setdefault(id(owner), []).append(name)
    kept = []
    with torch.no_grad():
        for _, m in pending:
            m.reset_parameters()
            for pname in first_site.get(id(m), []):
                kept.append((m._parameters[pname], m._parameters[pname].detach().clone()))
        for tensor, value in kept:
            tensor.copy_(value)
