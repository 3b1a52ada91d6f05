"""Finding the `fully_shard` units under a module without importing `FSDPModule` (no import cycle)."""
from __future__ import annotations

from typing import List

import torch.nn as nn


def fsdp2_units(root: nn.Module) -> List[nn.Module]:
    """`root` and the modules under it that `fully_shard` was applied to, in module order."""
    return [m for m in root.modules() if getattr(m, "_fsdp2_device_mesh", None) is not None]
