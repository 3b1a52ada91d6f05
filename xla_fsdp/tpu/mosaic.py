"""The Mosaic IR version our Pallas kernels are serialized at: one the installed libtpu accepts.

[Note: Mosaic IR version for libtpu 0.0.21]
A Pallas TPU kernel reaches libtpu as a `tpu_custom_call` whose backend config holds the
kernel's Mosaic module, serialized by jaxlib at an IR version jax picks per lowering. The
facts, read from the installed packages (jax 0.7.1, libtpu 0.0.21, torch_xla 2.9.0):
- jax/_src/tpu_custom_call.py:66-77, `get_ir_version(ctx)`: 4, 5, 6 or 7 when
  `is_cloud_tpu_older_than` 2025-06-19 / 07-25 / 07-27 / 08-14 (7 also when exporting in
  forward-compatibility mode); otherwise None, which `_lower_mosaic_module_to_asm`
  (same file, :356-380) turns into no `target-version`: jaxlib's newest, version 8.
- jax/_src/cloud_tpu_init.py:122-138, `is_cloud_tpu_older_than`: False when jax is not on a
  Cloud TPU VM; on one, compares the date of the timestamp in the runtime backend's
  `platform_version` ("Built on ... (SECONDS)") with the cutoff.
- libtpu 0.0.21's libtpu.so says "Built on Aug 15 2025 10:23:31 (1755278611)":
  2025-08-15 in every time zone from UTC-12 to UTC+14, so not older than 2025-08-14.
- torch_xla 2.9's `trace_pallas` (torch_xla/experimental/custom_kernel.py:211-257) lowers
  with `jax.jit(kernel).lower(...)`, i.e. through that same `get_ir_version`.
- libtpu 0.0.21 refuses version 8 ("Failed to deserialize the Mosaic module: INTERNAL:
  Unsupported version: expected <= 7 but got 8", measured with its deviceless compiler,
  docs/attention.md) and compiles the same kernels at 7.
So on a real TPU VM with these pins jax writes version 8 and libtpu refuses the kernel (the
compile is the same code whether or not a chip is attached; not run on a TPU here). On the
CPU host of the ahead-of-time check, too. `pin_ir_version()` caps the version at what the
installed libtpu accepts (`ACCEPTED`, by libtpu version; a libtpu not listed is left to jax).
"""
from __future__ import annotations

import threading
from typing import Optional

# libtpu version -> the newest Mosaic IR version it deserializes (measured: see the note above)
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
    """Make every later Pallas lowering in this process serialize at a version the installed
    libtpu accepts ([Note: Mosaic IR version for libtpu 0.0.21]); idempotent. Returns the cap
    (None: libtpu unknown here, jax's own choice stands)."""
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
