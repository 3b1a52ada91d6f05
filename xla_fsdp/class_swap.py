"""Giving one module instance extra behaviour by swapping its class.

Wrapping (FSDP, checkpointing) keeps the module object itself, so parameter names, state-dict keys and `isinstance`
checks against the user's class stay true (PyTorch's FSDP2 does the same). The mixed class is made once per (mixin,
class) pair."""
from typing import Dict, Tuple

import torch.nn as nn

_classes: Dict[Tuple[type, type], type] = {}


def mix_into(module: nn.Module, mixin: type, prefix: str) -> nn.Module:
    """Make `module` an instance of a subclass of (`mixin`, its class); returns it."""
    base = type(module)
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = type(f"{prefix}{base.__name__}", (mixin, base), {"__module__": base.__module__, "_swapped_from": base})
        _classes[(mixin, base)] = cls
    module.__class__ = cls
    return module


def unmix(module: nn.Module) -> nn.Module:
    """Undo `mix_into`: back to the class the module had before."""
    module.__class__ = original_class(module)
    return module


def original_class(module: nn.Module) -> type:
    """The class `module` had before `mix_into` (its own class if it was never swapped)."""
    return type(module).__dict__.get("_swapped_from", type(module))
