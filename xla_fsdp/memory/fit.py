"""How many checkpointed units keep their activations: `checkpoint_all_but_last="fit"`.

[Note: keep what fits] Recomputing a unit costs one more forward of it in backward; keeping its
activations costs HBM. How many units a chip can keep depends on the model, the batch, the slice,
the optimizer and what the TPU compiler makes of the program, so no fixed count suits every job
(the blog's pods have 6 to 15 GiB of v4's 30.75 left with every block recomputed, and a kept block
costs 0.7 to 1.4 GiB). "fit" measures instead of guessing:
- the first training step recomputes every checkpointed unit; each recomputation counts the bytes
  autograd saves in it (`saved_bytes`, the unit's own gathered parameters excluded: the engine
  re-gathers those), which is what the unit would hold from forward to backward if it
  kept its activations;
- at the next forward of the root, the device's own figures after that step (PJRT's peak bytes in
  use and its limit, `xm.get_memory_info`) give the room left: `HEADROOM` of the limit less the
  later steps' peak. That is the first step's peak plus what the device holds now and did not
  before it (the optimizer state the first step created after its backward's peak). The last units whose measured bytes, times `SAVED_TO_KEPT`, add up to at most that room
  keep their activations from then on (at most all but one, as with a count);
- every process and host takes the smallest count any of them found, so all run one program.
The step programs are two, as without "fit": the first step's (which creates the optimizer
state) and every later step's. The TPU compiler's account of a kept unit is smaller than
autograd's: it fuses elementwise work into its consumers and recomputes it for free. On the
TPU-compiled GPT-2 blocks a kept block held 0.46-0.5 of what autograd saves for it
(`SAVED_TO_KEPT`, docs/performance.md); where the estimate runs over, libtpu rematerializes to
fit on its own, at a small cost per block, rather than failing.
Where the device reports no memory figures (XLA:CPU: "GetAllocatorStats is not supported") every
unit keeps recomputing, said once. `XLA_FSDP_FIT_MEMORY` hands the figures in instead
(`{"peak": bytes, "limit": bytes}`): the ahead-of-time check does, from its first compile of the
job (docs/aot.md), and so do the tests.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence

FIT = "fit"
MEMORY_ENV = "XLA_FSDP_FIT_MEMORY"
HEADROOM = 0.95  # of the device's limit: allocator slack, the input pipeline's buffers
SAVED_TO_KEPT = 1.0  # a kept unit's HBM over its measured bytes (libtpu's account: 0.8-0.9, see the note)

_log = logging.getLogger("xla_fsdp")


def is_fit(value) -> bool:
    return isinstance(value, str) and value.lower() == FIT


def keep_count(saved: Sequence[int], peak: int, limit: int, headroom: float = HEADROOM,
               saved_to_kept: float = SAVED_TO_KEPT) -> int:
    """How many of the last units (in forward order; `saved[i]` the bytes autograd saves in unit
    i) keep their activations within `headroom * limit - peak` bytes; at most all but one."""
    room = headroom * limit - peak
    count = 0
    for size in reversed(list(saved)[1:]):  # the first unit always recomputes
        room -= saved_to_kept * size
        if room < 0:
            break
        count += 1
    return count


def device_figures(read: Optional[Callable[[], Dict[str, int]]] = None) -> Optional[Dict[str, int]]:
    """{"peak", "limit", "used"} in bytes: `XLA_FSDP_FIT_MEMORY` if set (a program's own peak and
    limit, "used" 0), else the device's own (None where it reports none)."""
    given = os.environ.get(MEMORY_ENV)
    if given:
        try:
            figures = json.loads(given)
            peak, limit = int(figures["peak"]), int(figures["limit"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{MEMORY_ENV}={given!r}: give the device's memory as JSON "
                             f"{{\"peak\": bytes, \"limit\": bytes}} ({e})") from None
        if limit <= 0 or peak < 0:
            raise ValueError(f"{MEMORY_ENV}={given!r}: need limit > 0 and peak >= 0")
        return {"peak": peak, "limit": limit, "used": 0, "given": True}
    try:
        info = (read or _read_xla)()
    except RuntimeError:  # XLA:CPU: "GetAllocatorStats is not supported"
        return None
    peak, limit = int(info.get("peak_bytes_used", 0)), int(info.get("bytes_limit", 0))
    if limit <= 0:
        return None
    return {"peak": peak, "limit": limit, "used": int(info.get("bytes_used", 0)), "given": False}


def _read_xla() -> Dict[str, int]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # executions run asynchronously: the figures of a finished step
    return xm.get_memory_info(torch_xla.device())


# autograd nodes (their op's name) that pass a tensor on unchanged in value: views, copies, casts,
# layouts. A saved tensor they made costs what the op before them costs.
_PASS_ON = frozenset("View Reshape ReshapeAlias UnsafeView Transpose Permute Expand Squeeze Unsqueeze T Split "
                     "SplitWithSizes Slice Select Clone ToCopy Contiguous AsStrided Alias Narrow Unbind Unfold "
                     "UnsafeSplit Chunk".split())
# elementwise work and normalizations: the TPU compiler recomputes their outputs inside the fusions
# that read them, from what they read, so a kept unit holds none of them
_RECOMPUTED = frozenset("Add Sub Mul Div Neg Pow Sqrt Rsqrt Exp Log Tanh Sigmoid Gelu Silu Relu Softplus Where "
                        "Clamp Sin Cos Abs Erf Reciprocal Rsub Fill MaskedFill Maximum Minimum Addcmul Addcdiv "
                        "Lerp NativeLayerNorm NativeBatchNorm LayerNorm RmsNorm FusedRmsNorm Mean Sum Cat Stack".split())


def _op(fn) -> str:
    """An autograd node's op: "AddmmBackward0" -> "Addmm"."""
    name = type(fn).__name__.rstrip("0123456789")
    return name[:-len("Backward")] if name.endswith("Backward") else name


def _held(fn) -> bool:
    """Whether a kept unit holds a tensor made by autograd node `fn` (None: a leaf, the unit's
    input): the outputs of matmuls, kernels and anything else not cheap to redo are held."""
    for _ in range(64):
        if fn is None:
            return True
        op = _op(fn)
        if op in _PASS_ON:
            nexts = [f for f, _ in fn.next_functions if f is not None]
            fn = nexts[0] if nexts else None
            continue
        return op not in _RECOMPUTED
    return True


@contextlib.contextmanager
def saved_bytes(module) -> Iterator[Dict[str, int]]:
    """What a unit would hold from forward to backward if it kept its activations: bytes of the
    tensors autograd saves inside the block that the TPU compiler keeps rather than recomputes
    (`_held`), each storage once (a view counts as its base); `module`'s own parameters as
    registered at the time (the gathered ones) left out. "autograd" is every saved byte."""
    import torch

    seen, stats, weights = set(), {"bytes": 0, "autograd": 0}, []

    def pack(t):
        base = t._base if t._base is not None else t
        if not weights:
            weights.append({id(v) for m in module.modules() for v in m._parameters.values() if v is not None})
        if id(base) not in seen and id(base) not in weights[0]:
            seen.add(id(base))
            size = base.numel() * base.element_size()
            stats["autograd"] += size
            if _held(t.grad_fn if t._base is None else base.grad_fn):
                stats["bytes"] += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield stats


class FitPlan:
    """The root's "fit": bytes measured per unit in the first step, then the count, once."""

    def __init__(self, agree: Optional[Callable[[int], int]] = None):
        self.saved: Dict[int, int] = {}  # id(unit) -> bytes autograd saved in its recomputation
        self.count: Optional[int] = None
        self._agree = agree
        self.figures: Optional[Dict[str, int]] = None
        self._before: Optional[Dict[str, int]] = None  # the device's figures at the first forward

    def record(self, unit, size: int) -> None:
        if self.count is None:
            self.saved[id(unit)] = max(size, self.saved.get(id(unit), 0))

    def resolve(self, units: List, read: Optional[Callable[[], Dict[str, int]]] = None) -> int:
        """The count for this forward: 0 until every unit was measured and the device has figures."""
        if self.count is not None:
            return self.count
        if not units or any(id(u) not in self.saved for u in units):
            if self._before is None:  # before the first step: what the device holds without it
                self._before = device_figures(read) or {}
            return 0  # the first step: every unit recomputes and is measured
        figures = device_figures(read)
        if figures is not None and not figures["given"]:
            if figures["peak"] <= (self._before or {}).get("peak", 0):
                return 0  # no step has run on the device since (a loop accumulating gradients)
            held = max(0, figures["used"] - (self._before or {}).get("used", 0))
            figures = {**figures, "peak": figures["peak"] + held}
        if figures is None:
            _log.warning("checkpoint_all_but_last=\"fit\": the device reports no memory figures (XLA:CPU "
                         "has none; set %s to give them), so every checkpointed unit keeps recomputing",
                         MEMORY_ENV)
            count = 0
        else:
            count = keep_count([self.saved[id(u)] for u in units], figures["peak"], figures["limit"])
        self.figures = figures
        measured = figures is not None and not figures["given"]  # given figures are the same everywhere
        self.count = self._agree(count) if self._agree is not None and measured else count
        _report(self, units)
        if figures is not None:
            _log.warning("checkpoint_all_but_last=\"fit\": the last %d of %d checkpointed units keep their "
                         "activations (peak %.2f GiB of %.2f after the first step; %.2f GiB saved per unit)",
                         self.count, len(units), figures["peak"] / 2 ** 30, figures["limit"] / 2 ** 30,
                         max(self.saved.values()) / 2 ** 30)
        return self.count


REPORT_ENV = "XLA_FSDP_FIT_REPORT"  # a file the resolved (or unresolvable) plan is written to: the check


def _report(plan: FitPlan, units: List) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    saved = [plan.saved[id(u)] for u in units]
    with open(path, "w") as f:
        json.dump({"count": plan.count, "units": len(units), "saved": saved, "figures": plan.figures,
                   "saved_to_kept": SAVED_TO_KEPT, "headroom": HEADROOM}, f)
