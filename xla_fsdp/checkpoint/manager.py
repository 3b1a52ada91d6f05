"""Checkpoints of a run in one folder: `checkpoint-<step>` directories, the latest complete
one, and keep-last-K rotation (Hugging Face Trainer's layout and `save_total_limit`)."""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn

from . import format as fmt
from .holdings import process_info
from .load import load_checkpoint
from .save import save_checkpoint

_NAME = re.compile(r"^checkpoint-(\d+)$")


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(step, path) of every complete `checkpoint-<step>` under `root`, oldest first.
    Partial saves (a crash mid-write) are skipped."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and fmt.is_complete(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str) -> Optional[str]:
    """The complete checkpoint with the highest step under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


class CheckpointManager:
    """Saves `checkpoint-<step>` under `root` and keeps the newest `keep_last` (None: all)."""

    def __init__(self, root: str, keep_last: Optional[int] = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least 1 checkpoint, or None for all")
        self.root = os.path.abspath(root)
        self.keep_last = keep_last

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"checkpoint-{step}")

    def save(self, step: int, model: nn.Module, optimizer=None, extra_state: Optional[Dict[str, Any]] = None) -> str:
        """Save, then drop the oldest complete checkpoints beyond `keep_last`. Every process calls it."""
        info = process_info(model)
        if info.rank == 0:
            os.makedirs(self.root, exist_ok=True)
        path = save_checkpoint(self.path(step), model, optimizer, step=step, extra_state=extra_state)
        if info.rank == 0 and self.keep_last is not None:
            for _, old in complete_checkpoints(self.root)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        info.barrier()
        return path

    def latest(self) -> Optional[str]:
        return latest_checkpoint(self.root)

    def load_latest(self, model: nn.Module, optimizer=None, extra_state=None) -> Optional[Dict[str, Any]]:
        """Load the newest complete checkpoint, if any; returns what `load_checkpoint` returns, or None."""
        path = self.latest()
        return None if path is None else load_checkpoint(path, model, optimizer, extra_state=extra_state)
