"""The HBM a training step needs on its device and what the device has, as the job can read them.

[Note: where the memory figures come from] In order:
- the fit variable (`environment.FIT_MEMORY`, {"peak": bytes, "limit": bytes}): handed in (the ahead-of-time
  check, from the program it compiled; tests);
- PJRT's own figures for the device (`xm.get_memory_info`: peak bytes in use and the limit), one process per chip;
- libtpu's compile log, under the single controller: torch_xla 2.9 gives no memory figures for the SPMD virtual
  device, but libtpu states every program's HBM as it compiles it ([Note: the HBM a TPU program needs] in
  tpu/compile_log.py): the largest program compiled since the first forward is the first step;
- none (XLA:CPU has no allocator statistics and writes no libtpu log).
Either figure of the first step stands for the later steps': that program's outputs include the optimizer state it
creates (not aliased to any argument, so counted), which the later steps hold as arguments instead.
"""
from __future__ import annotations

import json
from typing import Callable, Dict, Optional

from xla_fsdp.runtime import environment

MEMORY_ENV = environment.FIT_MEMORY


class Before:
    """What the device holds before the first step, and where libtpu's log ends then."""

    def __init__(self, read: Optional[Callable[[], Dict[str, int]]] = None):
        from ..tpu import compile_log

        self.pjrt = _pjrt(read) or {}
        self.log = compile_log.mark()


def figures(before: Before, read: Optional[Callable[[], Dict[str, int]]] = None) -> Optional[Dict]:
    """{"peak", "limit", "source"} in bytes for the later steps, or None: not known (yet)."""
    given = environment.get(MEMORY_ENV)
    if given:
        return _given(given)
    pjrt = _pjrt(read)
    if pjrt is not None:
        if pjrt["peak"] <= before.pjrt.get("peak", 0):
            return {"pending": True}  # the step has not run on the device yet
        return {"peak": pjrt["peak"], "limit": pjrt["limit"], "source": "pjrt"}
    from ..tpu import compile_log

    hbm = compile_log.largest_program_hbm(compile_log.since(before.log))
    if hbm is not None:
        return {"peak": hbm.total, "limit": hbm.usable, "source": "libtpu log"}
    return None


def _given(text: str) -> Dict:
    try:
        figures = json.loads(text)
        peak, limit = int(figures["peak"]), int(figures["limit"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MEMORY_ENV}={text!r}: give the device's memory as JSON "
                         f"{{\"peak\": bytes, \"limit\": bytes}} ({e})") from None
    if limit <= 0 or peak < 0:
        raise ValueError(f"{MEMORY_ENV}={text!r}: need limit > 0 and peak >= 0")
    return {"peak": peak, "limit": limit, "source": MEMORY_ENV}


def _pjrt(read) -> Optional[Dict[str, int]]:
    try:
        info = (read or _read_xla)()
    except RuntimeError:  # XLA:CPU: "GetAllocatorStats is not supported"; SPMD's virtual device
        return None
    limit = int(info.get("bytes_limit", 0))
    if limit <= 0:
        return None
    return {"peak": int(info.get("peak_bytes_used", 0)), "limit": limit, "used": int(info.get("bytes_used", 0))}


def _read_xla() -> Dict[str, int]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # executions run asynchronously: the figures of a finished step
    return xm.get_memory_info(torch_xla.device())

