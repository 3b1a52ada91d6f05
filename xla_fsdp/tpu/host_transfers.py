"""What a step moves between HBM and the host's memory, read from libtpu's optimized program.

[Note: host transfers in libtpu's program]
An offloaded recomputation policy ([Note: host offload] in memory/host_offload.py) annotates saved activations for
host memory. libtpu 0.0.21 places them in memory space 5 (layouts ending `S(5)`) and moves them asynchronously: a
`dynamic-update-slice-start` into an S(5) buffer writes one layer's slice to the host (a scanned loop's saved stack,
or libtpu's unrolled copy of it), a `dynamic-slice-start` from one reads a slice back, and a `copy-start` whose
destination or source is in S(5) moves a whole buffer (unscanned blocks). What the core computes before each
`-done` hides the move.

Read here: the bytes each way (a While body's once per trip), how many moves have a matmul beside them, and the
host buffers the program makes in S(5) per chip (an upper bound: a host-side copy of a buffer counts beside it).
The PCIe time is PROJECTED at `PCIE_BYTES_PER_S` per chip, each direction a serial lane of its own (full duplex).
With step_time's events the check charges the moves as the DCN's transfers are charged (dcn.lane_wait): each move of
the entry or of a While body's trip starts at its start and must end by its done, or the core waits (a body's on
the first trip's clock, once per trip); and the step is at least the busier direction's whole PCIe time
(`projected_seconds`).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from xla_fsdp.tpu import dcn, optimized_hlo as oh

HOST = "S(5)"
# The JAX scaling book ("How to think about TPUs", its worked problem on a v6e's PCIe: 1.5e10
# bytes/s between host and chip); assumed for every generation, as no TPU page gives a figure.
PCIE_BYTES_PER_S = 1.5e10
PCIE_SOURCE = "the JAX scaling book's v6e host link, 1.5e10 bytes/s each way (assumed for every chip)"
_ARRAY = re.compile(r"([a-z]+[0-9]*\[[0-9,]*\]\{[^}]*\})")
_STARTS = ("dynamic-update-slice-start", "dynamic-slice-start", "copy-start")


@dataclass
class HostTransfers:
    to_host_bytes: int = 0
    to_device_bytes: int = 0
    moves: int = 0
    with_matmul: int = 0           # moves with a matmul scheduled between start and done
    host_buffer_bytes: int = 0     # S(5) buffers the program allocates, per chip
    pcie_seconds: float = 0.0      # PROJECTED: the busier direction at PCIE_BYTES_PER_S
    in_loops: List[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _arrays(shape: str) -> List[tuple]:
    """(bytes, on the host) of each array in an HLO shape string, in order."""
    return [((oh.shape_bytes(text) or [0])[0], HOST in text) for text in _ARRAY.findall(shape)]


def _move(ins: oh.Instruction):
    """(bytes, to the host?) of an asynchronous move between HBM and host memory, else None."""
    if ins.opcode not in _STARTS or HOST not in ins.shape:
        return None
    arrays = [a for a in _arrays(ins.shape) if a[0] > 8]  # not the indices or the context
    device_side = [b for b, host in arrays if not host]
    if not device_side:
        return None
    if ins.opcode == "copy-start":  # (destination, source, context)
        return device_side[0], arrays[0][1]
    return device_side[0], ins.opcode == "dynamic-update-slice-start"


def is_move(ins: oh.Instruction) -> bool:
    """An asynchronous start moving data between HBM and host memory."""
    return _move(ins) is not None


def _moves(comp: List[oh.Instruction]):
    """(start position, bytes, to the host?, position of the `-done` waiting for it or -1) of each move in `comp`."""
    for pos, ins in enumerate(comp):
        move = _move(ins)
        if move is not None:
            yield pos, *move, next((p for p in range(pos + 1, len(comp)) if ins.name in comp[p].operands), -1)


def _read(comp: List[oh.Instruction], comps: Dict[str, List[oh.Instruction]], times: int, out: HostTransfers):
    for pos, size, to_host, done in _moves(comp):
        if to_host:
            out.to_host_bytes += size * times
        else:
            out.to_device_bytes += size * times
        out.moves += times
        if done >= 0 and any(oh.holds(i, comps) for i in comp[pos + 1:done]):
            out.with_matmul += times


_CREATORS = ("custom-call", "custom-call-done", "copy-done", "broadcast", "fusion")


def _buffers(comp: List[oh.Instruction]) -> int:
    """Bytes of the host buffers `comp` makes: S(5) results of AllocateBuffer, of host-side copies (HostExecute's done),
    of copies to the host and of fills; not slice writes into a buffer or the loops carrying it."""
    return sum(b for ins in comp if ins.opcode in _CREATORS and HOST in ins.shape and not ins.shape.startswith("(")
               for b, host in _arrays(ins.shape) if host)


def read(text: str, step_seconds: float = 0.0) -> HostTransfers:
    """The step's moves between HBM and host memory ([Note: host transfers in libtpu's program])."""
    comps = oh.computations(text)
    out = HostTransfers()
    entry = comps.get("ENTRY", [])
    _read(entry, comps, 1, out)
    out.host_buffer_bytes = _buffers(entry)
    for loop in oh.while_loops(text):
        before = out.moves
        _read(comps.get(loop["body"], []), comps, loop["trip_count"] or 1, out)
        if out.moves > before and not loop["trip_count"]:
            out.in_loops.append(loop["name"])
        out.host_buffer_bytes += _buffers(comps.get(loop["body"], []))
    out.pcie_seconds = max(out.to_host_bytes, out.to_device_bytes) / PCIE_BYTES_PER_S
    return out


def _jobs(comp: List[oh.Instruction]) -> List[tuple]:
    """A computation's moves as lane jobs (dcn.lane_wait's), lane 0 to the host and 1 back."""
    return [(pos, done, size / PCIE_BYTES_PER_S, 0 if to_host else 1) for pos, size, to_host, done in _moves(comp)]


def _trip_wait(body: List[oh.Instruction], events: list) -> float:
    """What one trip of a While body waits for its moves, on the body's clock in its first trip."""
    names = {ins.name for ins in body}
    first = [e.start for e in events if e.trip == 0 and e.name in names]
    return dcn.lane_wait(dcn.core_clock(body, events, trip=0, offset=min(first, default=0.0)), _jobs(body))


def summarize(text: str, spec, events: Optional[list] = None, core_seconds: float = 0.0) -> dict:
    """`read` for the check's report, with the slice's host facts; with step_time's `events`, the core's wait for the
    PCIe lanes and the step with it ([Note: host transfers in libtpu's program])."""
    moved = read(text).as_dict()
    if events is not None:
        comps = oh.computations(text)
        entry = comps.get("ENTRY", [])
        clock = dcn.core_clock(entry, events)
        wait = dcn.lane_wait(clock, _jobs(entry))
        for loop in oh.while_loops(text):
            body = comps.get(loop["body"], [])
            if any(is_move(ins) for ins in body):
                wait += (loop["trip_count"] or 1) * _trip_wait(body, events)
        moved.update(exposed_seconds=wait, projected_seconds=max(core_seconds + wait, moved["pcie_seconds"]))
    moved.update(chips_per_host=spec.chips_per_host, host_dram_bytes_per_chip=spec.chip.host_dram_bytes_per_chip,
                 pcie_bytes_per_s=PCIE_BYTES_PER_S)
    return moved


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 // 10 else f"{n / 2 ** 20:.1f} MiB"


def describe(h, projection) -> List[str]:
    """The report's lines for `summarize`'s dict (none without moves); `projection`: the step's."""
    if not h:
        return []
    per_host = h["host_buffer_bytes"] * h["chips_per_host"]
    dram = h["host_dram_bytes_per_chip"] * h["chips_per_host"]
    beside = f"{100 * h['with_matmul'] / h['moves']:.0f}%" if h["moves"] else "-"
    lines = [f"host offload: {h['moves']} moves, {h['to_host_bytes'] / 1e9:.3f} GB per chip to the host and "
             f"{h['to_device_bytes'] / 1e9:.3f} GB back, {beside} of the moves with a matmul scheduled beside "
             f"them; host memory {_gib(h['host_buffer_bytes'])} per chip, {_gib(per_host)} per host of "
             f"{h['chips_per_host']} chips" + (f" (of its {_gib(dram)} DRAM)" if dram else
                                              " (no cited DRAM figure for this chip's host)")]
    compute = projection["compute_seconds"] if projection else 0.0
    lines.append(f"  PROJECTED {h['pcie_seconds']:.3f} s on PCIe, the busier direction at "
                 f"{h['pcie_bytes_per_s'] / 1e9:.0f} GB/s per chip ({PCIE_SOURCE}); the step's compute is "
                 f"{compute:.3f} s" + ("" if h["pcie_seconds"] <= compute else ": the moves outlast it"))
    if "projected_seconds" in h:
        lines.append(f"  PROJECTED step with the host moves: {h['projected_seconds']:.3f} s (the core waits "
                     f"{h['exposed_seconds']:.3f} s for them; at least the busier direction's PCIe time)")
    if h.get("in_loops"):
        lines.append(f"  moves inside While loops of unknown trip count ({', '.join(h['in_loops'])}) counted once")
    return lines
