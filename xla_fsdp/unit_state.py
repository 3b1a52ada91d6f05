"""Which modules are units of the collective engine, and each unit's engine state.

[Note: one engine state per unit] Both front doors (`XlaFullyShardedDataParallel` and FSDP2's `fully_shard`) make a
module a unit by giving it one engine-state object (`collective_engine.state.FSDPState`: its parameter group, options,
hooks and the front door's policies). It is registered here and looked up here, by `state_of(module)`, and `units(root)`
is the one list of the units under a module. The state lives in the module's own `__dict__`, so it lives and dies with
the module, and is read from there rather than through attribute lookup: torch's `CheckpointWrapper` forwards attribute
lookups to the module it wraps, which would make the wrapper look like a unit too."""
from __future__ import annotations

from typing import Any, List, Optional

import torch.nn as nn

_KEY = "_fsdp_state"


def register(module: nn.Module, state: Any) -> None:
    """Make `module` a unit with engine state `state`."""
    module.__dict__[_KEY] = state


def unregister(module: nn.Module) -> None:
    """`module` is no unit any more (a wrap that failed half-way)."""
    module.__dict__.pop(_KEY, None)


def state_of(module: nn.Module) -> Optional[Any]:
    """The engine state of `module` if it is a unit, else None."""
    return module.__dict__.get(_KEY)


def is_unit(module: nn.Module) -> bool:
    return _KEY in module.__dict__


def units(root: nn.Module) -> List[nn.Module]:
    """`root` (if it is one) and every unit under it, in module order."""
    return [m for m in root.modules() if _KEY in m.__dict__]
