"""Host reads of device values inside the manual region: a Python error that names the line.

[Note: host reads in the manual region] Inside the single controller's manual-sharding region (manual_region.py) every
tensor is a per-device piece. Reading one back to the host (`bool(t)`, `t.item()`, `t.tolist()`, `int(t)`, `print(t)`,
`t.cpu()`) makes torch_xla compile and run the pending graph up to that tensor as a program of its own, whose result is
still manual-sharded with no way back to a global value: XLA's SPMD partitioner then aborts the process (`F
hlo_sharding.cc ... Check failed: !IsManual()`), with no Python traceback. Hugging Face models do this in their mask
code (`masking_utils._ignore_causal_mask_sdpa` reads whether the attention mask is all ones).

While a region runs, the Python entry points of such reads on XLA tensors raise `HostReadInManualRegion` instead, naming
the line that read and the fixes; so does `t.to("cpu")` (the methods are replaced only while a region runs, so `to`
costs nothing elsewhere). Not seen here (they still abort): reads made in C++ (`torch.equal`, boolean-mask indexing,
`nonzero`). Hugging Face's mask code is steered off its reads by `xla_fsdp.integrations.transformers` (its `is_tracing`
is true inside the region).
"""
from __future__ import annotations

import os
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Dict

import torch

# the Python entry points of a device-to-host read (all reach aten::_local_scalar_dense or a copy to CPU)
READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "cpu", "__repr__",
         "__format__", "to")

_lock = threading.Lock()
_active = 0
_saved: Dict[str, Callable] = {}
_TORCH_DIR = os.path.dirname(torch.__file__)


class HostReadInManualRegion(RuntimeError):
    """A value of an XLA tensor was read on the host inside the single controller's manual region."""


def _where() -> str:
    """The innermost frame outside torch and this file: the line that asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename == __file__ or frame.filename.startswith(_TORCH_DIR):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"
    return "an unknown line"


def _to_host(args, kwargs) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` copies to the CPU."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    if isinstance(target, str):
        target = torch.device(target)
    return isinstance(target, torch.device) and target.type == "cpu"


def _guarded(name: str, original: Callable, in_manual_region: Callable[[], bool]) -> Callable:
    def read(self, *args, **kwargs):
        if name == "to" and not _to_host(args, kwargs):
            return original(self, *args, **kwargs)
        if in_manual_region() and isinstance(self, torch.Tensor) and self.device.type == "xla":
            raise HostReadInManualRegion(
                f"{name}() of an XLA tensor (shape {tuple(self.shape)}, {self.dtype}) at {_where()}, inside "
                "the collective engine's per-device region (single-controller runtime): the host cannot read a "
                "per-device value there (XLA would abort with 'Check failed: !IsManual()'). Compute the value "
                "before calling the wrapped model, on the global tensor, and pass it as a Python value; or make "
                "the code not depend on tensor values (check xla_fsdp.collective_engine.manual_region.in_manual_region()); or "
                "use the GSPMD engine (engine='spmd', fsdp_config \"xla_fsdp_v2\": true). Hugging Face models: "
                "call xla_fsdp.integrations.transformers.enable(), which steers transformers' mask code "
                "off such reads")
        return original(self, *args, **kwargs)

    read.__name__ = name
    return read


@contextmanager
def refuse_host_reads(in_manual_region: Callable[[], bool]):
    """While inside: Python-level host reads of XLA tensors raise when `in_manual_region()` (all
    threads share the patched methods; the predicate answers for the calling thread)."""
    global _active
    with _lock:
        if _active == 0:
            for name in READS:
                _saved[name] = torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name))
                setattr(torch.Tensor, name, _guarded(name, getattr(torch.Tensor, name), in_manual_region))
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                for name in READS:
                    if name in torch.Tensor.__dict__ and name not in _ORIGINALLY_OWN:
                        delattr(torch.Tensor, name)
                    else:
                        setattr(torch.Tensor, name, _saved[name])
                _saved.clear()


_ORIGINALLY_OWN = frozenset(n for n in READS if n in torch.Tensor.__dict__)
