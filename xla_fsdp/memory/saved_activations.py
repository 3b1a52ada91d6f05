"""Measure activation memory: the bytes autograd saves for backward during a forward.

This is what gradient checkpointing trades for compute, measured exactly on any backend (independent of the
allocator and of XLA's scheduling).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch


@contextlib.contextmanager
def saved_activation_bytes() -> Iterator[Dict[str, int]]:
    """Count bytes of tensors saved for backward inside the block (each storage once): only what stays alive
    between forward and backward, not what a checkpointed layer's recomputation saves in backward."""
    seen = set()
    stats = {"bytes": 0, "tensors": 0}

    def pack(t: torch.Tensor):
        key = (t.device, t.data_ptr() if t.device.type != "xla" else id(t))
        if key not in seen:
            seen.add(key)
            stats["bytes"] += t.numel() * t.element_size()
            stats["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield stats
