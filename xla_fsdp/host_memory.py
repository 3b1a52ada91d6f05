"""Handing freed host memory back to the operating system.

[Note: freed host memory stays in the process] Sharding a unit frees its
full-size parameters, but glibc keeps freed blocks below its mmap threshold
(which grows to 32 MiB as large blocks are freed) in its arenas for reuse.
The next unit's tensors are allocated elsewhere often enough that the
process's resident size grows by about a unit per unit, and a deferred model
wrapped at world size 1 peaked at 2x its size although nothing held the freed
tensors. `malloc_trim(0)` returns those pages; it is cheap next to
materializing a unit, so the engine calls it once per unit.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Callable, Optional

_trim: Optional[Callable[[int], int]] = None
_looked_up = False


def _malloc_trim() -> Optional[Callable[[int], int]]:
    global _trim, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _trim = libc.malloc_trim  # glibc only; musl and macOS have none
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _trim = None
    return _trim


def release_freed_host_memory(collect: bool = False) -> None:
    """Return freed heap pages to the OS; a no-op where the C library cannot.

    `collect=True` first runs the cycle collector, for callers that may have
    dropped tensors held only by reference cycles (it costs tens of ms).
    """
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
