"""Checkpoints of a run in one folder: `checkpoint-<step>` directories, the latest complete one, and keep-last-K
rotation (Hugging Face Trainer's layout and `save_total_limit`).

The folder is a local or mounted path or an fsspec URL (`gs://bucket/run`, storage.py). Only directories holding the
COMPLETE marker count; rotation removes an old checkpoint's marker before its files, so a crash mid-rotation leaves
nothing that looks complete and is not ([Note: commit without rename], save.py). With `async_save=True` a save's files
are written beside training ([Note: saves beside training], save.py): `save` returns once this process's tensors are in
host memory, `poll()` at each step boundary commits the save once every process wrote its files, and `wait()` (the next
save, the end of the job) waits for it."""
from __future__ import annotations

import re
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn

from . import format as fmt
from . import storage
from .load import load_checkpoint
from .save import PendingSave, begin_save

_NAME = re.compile(r"^checkpoint-(\d+)$")


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(step, path) of every complete `checkpoint-<step>` under `root`, oldest first. Partial saves (a crash mid-write)
    are skipped."""
    st = storage.storage_for(root)
    return sorted((int(m.group(1)), st.join(root, name)) for name in st.listdir(root)
                  if (m := _NAME.match(name)) and fmt.is_complete(st.join(root, name)))


def latest_checkpoint(root: str) -> Optional[str]:
    """The complete checkpoint with the highest step under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


class CheckpointManager:
    """Saves `checkpoint-<step>` under `root` and keeps the newest `keep_last` (None: all)."""

    def __init__(self, root: str, keep_last: Optional[int] = None, async_save: bool = False):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least 1 checkpoint, or None for all")
        self.storage = storage.storage_for(root)
        self.root = self.storage.abspath(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: Optional[PendingSave] = None
        self._writer: Optional[threading.Thread] = None

    def path(self, step: int) -> str:
        return self.storage.join(self.root, f"checkpoint-{step}")

    def save(self, step: int, model: nn.Module, optimizer=None, extra_state: Optional[Dict[str, Any]] = None) -> str:
        """Save, then drop the oldest complete checkpoints beyond `keep_last`. Every process calls it. With
        `async_save`, the previous save is committed first and this one goes on beside training (`poll`, `wait`);
        returns the path either way."""
        self.wait()
        # the root is made by the save (with its parents), where a failure is every process's
        pending = begin_save(self.path(step), model, optimizer, step=step, extra_state=extra_state,
                             copy_now=self.async_save)
        if not self.async_save:
            pending.write()
            return self._commit(pending)
        self._pending = pending
        self._writer = threading.Thread(target=pending.write, name=f"xla_fsdp checkpoint-{step}")
        self._writer.start()
        return pending.path

    def poll(self) -> Optional[str]:
        """At a step boundary (every process): commit the save written beside training once every process has written
        its files; returns its path then, else None."""
        if self._pending is None or not self._pending.info.all_ok(self._pending.written.is_set()):
            return None
        return self.wait()

    def wait(self) -> Optional[str]:
        """Wait for the save written beside training and commit it (every process); returns its path, or None when none
        is under way. Its write error is raised here."""
        if self._pending is None:
            return None
        pending, writer = self._pending, self._writer
        self._pending = self._writer = None
        writer.join()
        return self._commit(pending)

    def _commit(self, pending: PendingSave) -> str:
        path = pending.commit()
        if pending.info.rank == 0 and self.keep_last is not None:
            for _, old in complete_checkpoints(self.root)[:-self.keep_last]:
                fmt.remove_checkpoint(old, ignore_errors=True)  # the marker first
        pending.info.barrier()
        return path

    def latest(self) -> Optional[str]:
        return latest_checkpoint(self.root)

    def load_latest(self, model: nn.Module, optimizer=None, extra_state=None) -> Optional[Dict[str, Any]]:
        """Load the newest complete checkpoint, if any; returns what `load_checkpoint` returns, or None."""
        path = self.latest()
        return None if path is None else load_checkpoint(path, model, optimizer, extra_state=extra_state)
