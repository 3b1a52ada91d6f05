"""The HBM a training step needs on its device and what the device has, as the job can read them.

[Note: where the memory figures come from] In order:
- `XLA_FSDP_FIT_MEMORY` ({"peak": bytes, "limit": bytes}): handed in (the ahead-of-time check,
  from the program it compiled; tests);
- PJRT's own figures for the device (`xm.get_memory_info`: the peak bytes in use and the limit),
  with one process per chip. The peak is the first step's; the optimizer state that step
  created after its backward's peak is added (what the device holds now and did not before);
- libtpu's compile log, under the single controller: torch_xla 2.9 gives no memory figures for
  the SPMD virtual device ("MemoryInfo not supported for SPMD virtual device"), but libtpu states
  every program's HBM as it compiles it ([Note: the HBM a TPU program needs] in
  tpu/compile_log.py). The largest program compiled since the first forward is the first step;
  the optimizer state it created (every optimizer's state tensors, per device) is added;
- none (XLA:CPU has no allocator statistics and writes no libtpu log).
"""
from __future__ import annotations

import gc
import json
import os
import re
import warnings
from typing import Callable, Dict, Optional

MEMORY_ENV = "XLA_FSDP_FIT_MEMORY"


class Before:
    """What the device holds before the first step, and where libtpu's log ends then."""

    def __init__(self, read: Optional[Callable[[], Dict[str, int]]] = None):
        self.pjrt = _pjrt(read) or {}
        self.log = _log_mark()


def figures(before: Before, read: Optional[Callable[[], Dict[str, int]]] = None) -> Optional[Dict]:
    """{"peak", "limit", "source"} in bytes for the later steps, or None: not known (yet)."""
    given = os.environ.get(MEMORY_ENV)
    if given:
        return _given(given)
    pjrt = _pjrt(read)
    if pjrt is not None:
        if pjrt["peak"] <= before.pjrt.get("peak", 0):
            return {"pending": True}  # no step has run since (a loop accumulating gradients)
        held = max(0, pjrt["used"] - before.pjrt.get("used", 0))
        return {"peak": pjrt["peak"] + held, "limit": pjrt["limit"], "source": "pjrt"}
    hbm = _libtpu(before.log)
    if hbm is not None:
        return {"peak": hbm.total + optimizer_state_bytes(), "limit": hbm.usable, "source": "libtpu log"}
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


def _log_mark():
    from ..tpu import compile_log

    return compile_log.mark()


def _libtpu(mark):
    from ..tpu import compile_log

    return compile_log.largest_program_hbm(compile_log.since(mark))


def optimizer_state_bytes() -> int:
    """Bytes of every optimizer's state tensors on one device (each XLA tensor's shard)."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        optimizers = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type == "xla":
                    total += value.numel() * value.element_size() // _shards(value)
    return total


_TILES = re.compile(r"devices=\[([\d,]+)\]")


def _shards(tensor) -> int:
    """Into how many pieces an XLA tensor's sharding cuts it (1: replicated or unsharded)."""
    import torch_xla

    try:
        spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    except RuntimeError:
        return 1
    m = _TILES.search(spec or "")
    if not m:
        return 1
    tiles = [int(x) for x in m.group(1).split(",")]
    if "last_tile_dim_replicate" in spec:
        tiles = tiles[:-1]
    count = 1
    for t in tiles:
        count *= t
    return max(count, 1)
