"""Finding the `fully_shard` units under a module without importing `FSDPModule` (no import cycle)."""
from __future__ import annotations

from typing import List

import torch.nn as nn


def fsdp2_units(root: nn.Module) -> List[nn.Module]:
    """`root` and the modules under it that `fully_shard` was applied to, in module order. Read from
    each module's own attributes: torch's CheckpointWrapper forwards attribute lookups to the
    module it wraps, so `getattr` would count the wrapper as a unit too."""
    return [m for m in root.modules() if m.__dict__.get("_fsdp2_device_mesh") is not None]
