"""How many checkpointed units keep their activations: `checkpoint_all_but_last="fit"`.

[Note: keep what fits] Recomputing a unit costs one more forward of it in backward; keeping its activations costs
HBM. How many units a chip can keep depends on the model, the batch, the slice, the optimizer and what the TPU
compiler makes of the program, so no fixed count suits every job (the blog's pods have 6 to 16 GiB of v4's 30.75
left with every block recomputed, and a kept block costs 0.7 to 1.4 GiB). "fit" measures instead of guessing:
- the first training step recomputes every checkpointed unit; each recomputation counts what the unit would hold
  from forward to backward if it kept its activations (`kept_bytes.saved_bytes`: the saved matmul and kernel
  outputs and its input; not its gathered weights, which the engine re-gathers, nor elementwise results, which
  libtpu recomputes inside its fusions);
- at the next forward of the root, the first step's peak and the device's limit ([Note: where the memory figures
  come from] in device_figures.py) give the room: `HEADROOM` of the limit less that peak. The last units whose
  measured bytes (times `SAVED_TO_KEPT`) fit in it keep their activations from then on (at most all but one);
- every process and host takes the smallest count any of them found, so all run one program;
- the count is kept beside the persistent compilation cache (`XLA_PERSISTENT_CACHE_PATH`), so a restarted job,
  whose first step loads from the cache and compiles nothing (libtpu then logs no HBM figures), chooses the same
  count and finds its later steps' program in the cache too.
The step programs stay two, as without "fit": the first step's (which creates the optimizer state) and every later
step's. The estimate leans high on purpose (`SAVED_TO_KEPT`): where the kept blocks outgrow HBM libtpu does not
always rematerialize to fit, so a count too high stops the job when its second step compiles; `python -m
xla_fsdp.aot` compiles that step before a slice is rented. Kept activations fill libtpu's scheduler budget for the
whole backward; on pods xla_fsdp sets it to 90% ([Note: the scheduler's budget on pods] in tpu/libtpu_flags.py),
or the collectives lose the compute beside them. Where no figures exist (XLA:CPU) every unit keeps recomputing,
said once; the fit variable (`environment.FIT_MEMORY`, `{"peak": bytes, "limit": bytes}`) hands them in: the
ahead-of-time check does, from its first compile of the job (docs/aot.md), and so do the tests.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Callable, Dict, List, Optional, Sequence

from ..runtime import environment
from .device_figures import MEMORY_ENV, Before, figures as device_figures

FIT = "fit"
HEADROOM = 0.95  # of the device's limit: allocator slack, the input pipeline's buffers
# a kept unit's HBM by libtpu's account over what `saved_bytes` measures for it was 0.16 to 1.03 on the blog's pods
# (docs/performance.md). Kept at 1: a count too high stops the job at its second step's compile, one too low costs
# a little speed
SAVED_TO_KEPT = 1.0
STORED = "xla_fsdp_fit.json"  # beside the persistent compilation cache

_log = logging.getLogger("xla_fsdp")


def is_fit(value) -> bool:
    return isinstance(value, str) and value.lower() == FIT


def keep_count(saved: Sequence[int], peak: int, limit: int, headroom: float = HEADROOM,
               saved_to_kept: float = SAVED_TO_KEPT) -> int:
    """How many of the last units (`saved`: each one's bytes) keep activations within `headroom * limit - peak`."""
    room = headroom * limit - peak
    count = 0
    for size in reversed(list(saved)[1:]):  # the first unit always recomputes
        room -= saved_to_kept * size
        if room < 0:
            break
        count += 1
    return count


def last_unit_fits_over_time(saved_last: int, breakdown: Dict, limit: int, headroom: float = HEADROOM,
                             saved_to_kept: float = SAVED_TO_KEPT) -> bool:
    """[Note: keep what fits, over time] The count above sets every kept unit against the all-recomputed step's peak,
    but a kept unit's activations live from its forward to its backward, and where that peak lies deeper in the
    backward they are dead by then (the 2B GPT-2 on two v4-8 slices: peak 25.45 GB at a middle block's attention
    backward, 14.4 GB between the loss and the backward's start; docs/pods.md). With the compiled step's memory over
    time (`tpu.memory_breakdown`'s curve, which the check has and a running job does not), the last unit fits where
    what the step holds before its backward, plus what libtpu's peak holds beyond the curve, plus the unit's bytes,
    is within `headroom` of the limit; its own backward then reads what its recomputation would have made. A hint the
    check prints, not a count "fit" takes: the job cannot see the curve, and the check reports what the job does."""
    slack = max(int(breakdown["peak"]) - int(breakdown["curve_peak"]), 0)
    return int(breakdown["before_backward"]) + slack + saved_to_kept * saved_last <= headroom * limit


# [Note: a policy per block] `remat_policy="fit"` chooses, per checkpointed unit, what it saves: with the room "fit"
# measures, every unit from the last backwards gets the richest policy the room still holds, "minimal" (every
# matmul's output), else "save_dot_except_mlp", else "save_qkv_proj", else "full" (a policy costs the bytes of the
# outputs it saves, measured by role in the first step's recomputations); then, from the last backwards, units
# holding "minimal" keep everything ("none") while the rest of a whole unit's bytes fits. Saved matmul outputs cost a
# fraction of a kept unit and skip most of its recomputed FLOPs, so the room goes to many units' matmuls before a
# few units' whole activations. The first unit never keeps everything, as with a count.
LADDER = ("minimal", "save_dot_except_mlp", "save_qkv_proj")
_ROLES_OF = {"minimal": ("qkv", "out", "mlp", "other"), "save_dot_except_mlp": ("qkv", "out"),
             "save_qkv_proj": ("qkv",)}


def fit_policies(saved: Sequence[int], roles: Sequence[Dict[str, int]], room: float,
                 saved_to_kept: float = SAVED_TO_KEPT) -> List[str]:
    """[Note: a policy per block]: each unit's policy name (forward order) within `room` bytes."""
    names = ["full"] * len(saved)
    costs = [{name: saved_to_kept * sum(r.get(role, 0) for role in _ROLES_OF[name]) for name in LADDER}
             for r in roles]
    for i in reversed(range(len(saved))):
        for name in LADDER:
            if 0 < costs[i][name] <= room:
                names[i], room = name, room - costs[i][name]
                break
    for i in reversed(range(1, len(saved))):
        if names[i] != "minimal":
            break
        extra = max(saved_to_kept * saved[i] - costs[i]["minimal"], 0)
        if extra > room:
            break
        names[i], room = "none", room - extra
    return names


class FitPlan:
    """The root's "fit": bytes measured per unit in the first step, then the count (and with `policies` each policy)."""

    def __init__(self, agree: Optional[Callable[[int], int]] = None, policies: bool = False):
        self.saved: Dict[int, int] = {}  # id(unit) -> what it would hold, measured in its recomputation
        self.roles: Dict[int, Dict[str, int]] = {}  # id(unit) -> its matmuls' output bytes by role
        self.policies = policies
        self.assigned: Optional[List[str]] = None  # with `policies`: each unit's, in forward order
        self.count: Optional[int] = None
        self.figures: Optional[Dict] = None
        self._agree = agree
        self._before: Optional[Before] = None
        self._steps = 0

    def record(self, unit, size: int, roles: Optional[Dict[str, int]] = None) -> None:
        if self.count is None:
            self.saved[id(unit)] = max(size, self.saved.get(id(unit), 0))
            if roles is not None:
                self.roles[id(unit)] = roles

    def resolve(self, units: List, read: Optional[Callable[[], Dict[str, int]]] = None) -> int:
        """The count for this forward: 0 until every unit was measured in a step that ended and the figures exist."""
        if self.count is not None:
            return self.count
        if self._before is None:  # before the first step: what the device holds without it
            _count_optimizer_steps()
            self._before, self._steps = Before(read), _STEPS[0]
            return 0
        if not units or any(id(u) not in self.saved for u in units) or _STEPS[0] == self._steps:
            return 0  # the first step: every unit recomputes and is measured
        saved = [self.saved[id(u)] for u in units]
        stored = _stored(saved)
        if stored is not None and (stored.get("policies") is not None) != self.policies:
            stored = None  # chosen for the other kind of "fit"
        found = device_figures(self._before, read) if stored is None else None
        if found is not None and found.get("pending"):
            return 0
        if stored is not None:
            count, self.figures = stored["count"], stored.get("figures")
            self.assigned = stored.get("policies")
        elif found is None:
            _log.warning("checkpoint_all_but_last=\"fit\": no memory figures for this device (XLA:CPU has "
                         "none; set %s to give them), so every checkpointed unit keeps recomputing", MEMORY_ENV)
            count = 0
        elif self.policies:  # [Note: a policy per block]: every process the smallest room (KiB)
            room = int(max(HEADROOM * found["limit"] - found["peak"], 0)) >> 10
            if self._agree is not None and found["source"] != MEMORY_ENV:
                room = self._agree(room)
            self.assigned = fit_policies(saved, [self.roles.get(id(u), {}) for u in units], room << 10)
            count, self.figures = self.assigned.count("none"), found
        else:
            count, self.figures = keep_count(saved, found["peak"], found["limit"]), found
        if self._agree is not None and found is not None and found["source"] != MEMORY_ENV and not self.policies:
            count = self._agree(count)  # figures read on each process may differ by a little
        self.count = count
        if found is not None:
            _store(saved, count, found, self.assigned)
        if found is not None and self.assigned is not None:
            _log.warning("remat_policy=\"fit\": the %d checkpointed units save %s (forward order; later steps' "
                         "peak %.2f GiB of %.2f, from %s)", len(units), ", ".join(self.assigned),
                         found["peak"] / 2 ** 30, found["limit"] / 2 ** 30, found["source"])
        elif found is not None:
            _log.warning("checkpoint_all_but_last=\"fit\": the last %d of %d checkpointed units keep their "
                         "activations (later steps' peak %.2f GiB of %.2f, from %s; %.2f GiB a unit)",
                         count, len(units), found["peak"] / 2 ** 30, found["limit"] / 2 ** 30, found["source"],
                         max(saved) / 2 ** 30)
        _report(self, saved)
        return count


_STEPS = [0]  # optimizer steps taken in this process, once counted


@functools.lru_cache(maxsize=None)  # one hook per process
def _count_optimizer_steps():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def count(optimizer, args, kwargs):
        _STEPS[0] += 1

    return register_optimizer_step_post_hook(count)


def _stored_path() -> Optional[str]:
    cache = environment.get(environment.TORCH_XLA_CACHE)
    return os.path.join(cache, STORED) if cache else None


def _job(saved: List[int]) -> Dict:
    """What a stored count is valid for: the units' measured bytes on the same devices."""
    try:
        import torch_xla.runtime as xr

        devices = [xr.device_type(), xr.global_runtime_device_count()]
    except (ImportError, RuntimeError):
        devices = []
    return {"saved": saved, "devices": devices}


def _stored(saved: List[int]) -> Optional[Dict]:
    """The count an earlier run of this job chose (same units, bytes and devices), if kept."""
    path = _stored_path()
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if record.get("job") == _job(saved) else None


def _store(saved: List[int], count: int, found: Dict, policies: Optional[List[str]] = None) -> None:
    path = _stored_path()
    if found["source"] == MEMORY_ENV or not path or not os.path.isdir(os.path.dirname(path)):
        return  # figures handed in (the check, tests) are not this device's
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:  # whole or not at all
        json.dump({"job": _job(saved), "count": count, "figures": found, "policies": policies}, f)
    os.replace(tmp, path)


def _report(plan: FitPlan, saved: List[int]) -> None:
    path = environment.aot().get("fit_report")
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"count": plan.count, "units": len(saved), "saved": saved, "figures": plan.figures,
                   "saved_to_kept": SAVED_TO_KEPT, "headroom": HEADROOM, "policies": plan.assigned}, f)
