"""The Mosaic IR version our Pallas kernels are serialized at: one the installed libtpu accepts.

[Note: Mosaic IR version for libtpu 0.0.21]
A Pallas TPU kernel reaches libtpu as a `tpu_custom_call` holding the kernel's Mosaic module, serialized by jaxlib
at an IR version jax picks per lowering (jax 0.7.1, libtpu 0.0.21, torch_xla 2.9.0):
- jax/_src/tpu_custom_call.py `get_ir_version(ctx)`: 4 to 7 when `is_cloud_tpu_older_than` 2025-06-19 / 07-25 /
  07-27 / 08-14 (7 also when exporting in forward-compatibility mode), else None: jaxlib's newest, version 8.
  `is_cloud_tpu_older_than` is False off a Cloud TPU VM; on one it compares the build date in the runtime's
  `platform_version` with the cutoff, and libtpu 0.0.21 was built on 2025-08-15 (in every time zone).
- torch_xla 2.9's `trace_pallas` lowers through that same `get_ir_version`.
- libtpu 0.0.21 refuses version 8 ("Unsupported version: expected <= 7 but got 8", measured with its deviceless
  compiler, docs/attention.md) and compiles the same kernels at 7.
So with these pins jax writes version 8 and libtpu refuses the kernel, on a TPU VM and on the check's CPU host
alike. `pin_ir_version()` caps the version at what the installed libtpu accepts (`ACCEPTED`, by libtpu version; a
libtpu not listed is left to jax).
"""
from __future__ import annotations

import threading
from typing import Optional

# libtpu version -> the newest Mosaic IR version it deserializes (see the note above)
ACCEPTED = {"0.0.21": 7}

_lock = threading.Lock()
_pinned: Optional[int] = None


def libtpu_version() -> Optional[str]:
    """The installed libtpu package's version, or None without one."""
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def accepted_version(libtpu: Optional[str] = None) -> Optional[int]:
    """The newest Mosaic IR version `libtpu` (default: the installed one) accepts; None: unknown."""
    return ACCEPTED.get(libtpu if libtpu is not None else (libtpu_version() or ""))


def capped(jax_choice: Optional[int], accepted: Optional[int]) -> Optional[int]:
    """jax's choice (None: jaxlib's newest) capped at `accepted` (None: no cap)."""
    if accepted is None:
        return jax_choice
    return accepted if jax_choice is None else min(jax_choice, accepted)


def pin_ir_version() -> Optional[int]:
    """Make later Pallas lowerings in this process serialize at a version the installed libtpu accepts (idempotent); the
    cap, or None (libtpu unknown: jax's choice stands)."""
    global _pinned
    accepted = accepted_version()
    if accepted is None:
        return None
    with _lock:
        if _pinned is None:
            from jax._src import tpu_custom_call

            jax_choice = tpu_custom_call.get_ir_version
            tpu_custom_call.get_ir_version = lambda ctx: capped(jax_choice(ctx), accepted)
            _pinned = accepted
    return _pinned
