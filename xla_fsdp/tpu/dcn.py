"""What a multislice step sends between slices, read from libtpu's optimized program.

[Note: DCN transfers in libtpu's program]
Compiled for several slices (the topology option `num_slices`), libtpu 0.0.21 keeps the collectives within a
slice as ICI collectives over slice-local device ids and turns each one that crosses slices into host transfers
its megascale runtime handles: a `send` of this chip's buffer and a `recv` of the result (`is_host_transfer=true`,
`_xla_host_transfer_handler_name="xla_megascale_runtime"`, `_xla_megascale_transfer_type`, e.g. ALL_REDUCE, and
one `_xla_host_transfer_rendezvous` naming the pair), each waited for by a `send-done` / `recv-done`. The data
crosses the data-center network (DCN) through the host and comes back reduced: one transfer's bytes are the
send's buffer, its window runs from the send to its recv-done, and what the core computes in it hides it.

The projection charges each transfer on one serial DCN lane per chip (`ring_factor`), at the chip's share of its
host's DCN bandwidth (`Chip.dcn_bytes_per_s`, or the check's --dcn_gbps); where the lane has not finished by the
recv-done, the core waits. Transfers inside While loops are not read (no shipped recipe puts a cross-slice
collective in a loop body); the report says when a loop holds some.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from xla_fsdp.tpu import optimized_hlo as oh

MEGASCALE = "xla_megascale_runtime"
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]+)"')
_TYPE = re.compile(r'_xla_megascale_transfer_type="([^"]+)"')


@dataclass
class Transfer:
    """One cross-slice collective of the entry computation."""

    name: str               # the send
    kind: str               # the megascale transfer type, e.g. "ALL_REDUCE"
    bytes: int              # this chip's buffer
    position: int           # the send's place in the schedule
    done_position: int      # its recv-done's (-1: not found)
    beside_compute: int = 0   # compute instructions scheduled in the window
    beside_matmuls: int = 0   # of which holding a matmul

    def as_dict(self) -> dict:
        return asdict(self)


def transfers(text: str) -> List[Transfer]:
    """The entry computation's megascale transfers, in schedule order ([Note: DCN transfers in libtpu's program])."""
    comps = oh.computations(text)
    entry = comps.get("ENTRY", [])
    recv_of: Dict[str, str] = {}   # rendezvous -> the recv's name
    done_at: Dict[str, int] = {}   # recv name -> its recv-done's position
    for pos, ins in enumerate(entry):
        if ins.opcode == "recv" and MEGASCALE in ins.rest:
            m = _RENDEZVOUS.search(ins.rest)
            if m:
                recv_of[m.group(1)] = ins.name
        elif ins.opcode == "recv-done" and ins.operands:
            done_at[ins.operands[0]] = pos
    out = []
    for pos, ins in enumerate(entry):
        if ins.opcode != "send" or MEGASCALE not in ins.rest:
            continue
        done = done_at.get(recv_of.get(oh.group(_RENDEZVOUS, ins.rest), ""), -1)
        t = Transfer(ins.name, oh.group(_TYPE, ins.rest), max(oh.shape_bytes(ins.shape), default=0), pos, done)
        if done > pos:
            window = [i for i in entry[pos + 1:done] if i.opcode in ("fusion", "convolution", "dot", "custom-call")]
            t.beside_compute = len(window)
            t.beside_matmuls = sum(oh.holds(i, comps) for i in window)
        out.append(t)
    return out


def in_loops(text: str) -> int:
    """Megascale sends inside While bodies (not read by `transfers`)."""
    comps = oh.computations(text)
    bodies = {oh.loop_body(i) for i in comps.get("ENTRY", []) if i.opcode == "while"}
    return sum(1 for b in bodies for i in comps.get(b, []) if i.opcode == "send" and MEGASCALE in i.rest)


def ring_factor(kind: str, slices: int) -> float:
    """What one chip sends over DCN on a ring of S slices per byte of its buffer: all-reduce 2(S-1)/S, reduce-scatter
    (S-1)/S, all-gather S-1 (as read in libtpu 0.0.21's programs), else 1."""
    if slices <= 1:
        return 0.0
    return {"ALL_REDUCE": 2 * (slices - 1) / slices, "REDUCE_SCATTER": (slices - 1) / slices,
            "ALL_GATHER": float(slices - 1)}.get(kind, 1.0)


def summarize(text: str, slices: int, dcn_bytes_per_s: float, events: Optional[list] = None,
              core_seconds: float = 0.0) -> dict:
    """The report's DCN figures: transfers, bytes per chip (buffers, and sent on the ring), the share with compute (and
    a matmul) in their window; with step_time's `events`, the core's wait for the DCN lane and the step with it."""
    found = transfers(text)
    total = sum(t.bytes for t in found)
    sent = sum(t.bytes * ring_factor(t.kind, slices) for t in found)
    out = {"slices": slices, "transfers": len(found), "bytes_per_chip": total, "sent_per_chip": sent,
           "beside_compute_fraction": sum(t.bytes for t in found if t.beside_compute) / total if total else 0.0,
           "beside_matmul_fraction": sum(t.bytes for t in found if t.beside_matmuls) / total if total else 0.0,
           "dcn_bytes_per_s": dcn_bytes_per_s, "dcn_seconds": sent / dcn_bytes_per_s if dcn_bytes_per_s else 0.0,
           "in_loops": in_loops(text), "by_type": {}}
    for t in found:
        k = out["by_type"].setdefault(t.kind, {"transfers": 0, "bytes": 0})
        k["transfers"] += 1
        k["bytes"] += t.bytes
    if events is not None and dcn_bytes_per_s and found:  # one serial DCN lane: each transfer lands by its recv-done
        clock = core_clock(oh.computations(text).get("ENTRY", []), events)
        wait = lane_wait(clock, [(t.position, t.done_position, t.bytes * ring_factor(t.kind, slices) / dcn_bytes_per_s,
                                  0) for t in found])
        first = clock[min(t.position for t in found)]
        # libtpu 0.0.21 issues run_clm's cross-slice all-reduces after the backward, however early (docs/pods.md)
        out.update(exposed_seconds=wait, projected_seconds=core_seconds + wait,
                   first_send_fraction=first / core_seconds if core_seconds else 0.0)
    return out


def core_clock(comp: list, events: list, trip: int = -1, offset: float = 0.0) -> List[float]:
    """The core's PROJECTED time when each position of `comp` is reached (one more for the end), from step_time's
    `events`: the entry's (`trip` -1), where a While loop's position is reached when its last trip's events end, or a
    While body's in its trip `trip`, less `offset` (the trip's start)."""
    place = {ins.name: pos for pos, ins in enumerate(comp)}
    whiles = [pos for pos, ins in enumerate(comp) if ins.opcode == "while"]
    clock = [0.0] * (len(comp) + 1)
    last = -1
    for e in events:
        if trip < 0 and e.trip >= 0:  # a loop body's: the loop after the last entry instruction seen ends then
            pos = next((w for w in whiles if w > last), None)
        elif e.trip != trip:
            continue
        else:
            pos = place.get(e.name)
            if pos is None or e.asynchronous:
                continue
            last = pos
        if pos is not None:
            clock[pos + 1] = max(clock[pos + 1], e.end - offset)
    for pos in range(1, len(clock)):
        clock[pos] = max(clock[pos], clock[pos - 1])
    return clock


def lane_wait(clock: List[float], jobs: List[Tuple[int, int, float, int]]) -> float:
    """Seconds the core waits for serial lanes: each job (start position, done position or -1, seconds, lane) starts
    when issued and its lane is free, and must end by its done; a late one delays the core, and all after it."""
    lanes: Dict[int, float] = {}
    shift = 0.0
    for start_pos, done_pos, seconds, lane in sorted(jobs):
        start = max(lanes.get(lane, 0.0), clock[start_pos] + shift)
        lanes[lane] = start + seconds
        needed = clock[done_pos] + shift if done_pos >= 0 else lanes[lane]
        if lanes[lane] > needed:
            shift += lanes[lane] - needed
    return shift
