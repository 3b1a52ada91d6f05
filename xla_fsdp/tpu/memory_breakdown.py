"""What a TPU program's peak HBM is made of, from libtpu's buffer assignment and schedule.

[Note: the peak HBM, broken down]
libtpu sizes a program at its arguments, its outputs that do not reuse an argument, and the program itself (the
heap of temporaries with its fragmentation, and the code) ([Note: the HBM a TPU program needs] in compile_log.py).
The buffer assignment ([Note: libtpu's buffer assignment]) names every allocation, so each part is split further:
- arguments, by what the job holds in them: parameters, optimizer state, gradients kept between steps, and other
  inputs (the batch, RNG state). The traced job lists its tensors by kind with their shapes (aot/capture.py); an
  entry parameter takes the kind of a tensor of its dtype and shape (tensors of one shape have one size per chip,
  so the sums are exact even where a parameter and its Adam moments share a shape);
- the heap of temporaries at its fullest moment: every HBM value in it lives from the instruction that defines it
  to the last one that reads it, in libtpu's schedule (a While loop's body and condition where the loop runs). At
  the instant the most bytes are alive, each live value is gathered parameters (an all-gather's result), gradients
  (a reduce-scatter's or all-reduce's result, or what one reads), activations (made by the job's forward and read
  by autograd's backward, told apart by the source line torch_xla writes in each instruction's metadata), or
  temporaries (the rest). What the heap holds beyond that instant's live bytes is its fragmentation;
- the program's code, constants and overlays: libtpu's program figure less the heap.
The parts are summed and set against libtpu's own peak; what is not attributed is reported.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from xla_fsdp.tpu import buffer_assignment as bam
from xla_fsdp.tpu import hlo_source
from xla_fsdp.tpu import optimized_hlo as oh

PARTS = ("parameters", "optimizer state", "gradients", "gathered parameters", "activations", "temporaries",
         "heap fragmentation", "other inputs", "outputs", "code and overlays")
ARGUMENT_KINDS = ("parameters", "optimizer state", "gradients")
_NESTED = (re.compile(r"condition=%?([\w.\-]+)"), re.compile(r"body=%?([\w.\-]+)"),
           re.compile(r"to_apply=%?([\w.\-]+)"), re.compile(r"branch_computations=\{([^}]*)\}"),
           re.compile(r"true_computation=%?([\w.\-]+)"), re.compile(r"false_computation=%?([\w.\-]+)"))
TORCH_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int64": "s64",
                "int32": "s32", "int16": "s16", "int8": "s8", "uint8": "u8", "bool": "pred"}
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\]")


def schedule(text: str, comps=None) -> List[str]:
    """The program's instructions in run order: the entry's, with each loop's, call's or conditional's where it runs."""
    comps = comps if comps is not None else oh.computations(text)
    order: List[str] = []

    def walk(name: str, depth: int) -> None:
        for ins in comps.get(name, []):
            if ins.opcode in ("while", "call", "conditional") and depth < 8:
                for pattern in _NESTED:
                    m = pattern.search(ins.rest)
                    if m:
                        for called in re.findall(r"%?([\w.\-]+)", m.group(1)):
                            walk(called, depth + 1)
            order.append(ins.name)

    walk("ENTRY", 0)
    return order


def _phase(rest: str) -> str:
    """"backward" for an instruction autograd's engine issued (no Python source line: its thread runs no Python;
    or a *_backward op), "optimizer" for torch.optim's, "engine" for xla_fsdp's collective code, else "forward"."""
    where = hlo_source.source(rest)
    op = hlo_source.op_type(rest)
    if op.endswith("_backward"):
        return "backward"
    if where is None:
        return "backward" if op else "unknown"
    if "/torch/optim/" in where[0]:
        return "optimizer"
    if "/xla_fsdp/collective_engine/" in where[0]:
        return "engine"
    return "forward"


def _collective_labels(order: List[str], instrs, comps) -> Dict[str, str]:
    """Instruction -> "gathered parameters" / "gradients": collectives' results and what the engine makes of them."""
    labels: Dict[str, str] = {}
    for name in order:
        ins = instrs.get(name)
        if ins is None:
            continue
        kind = oh._collective_kind(ins, comps)
        if kind == "collective-permute":
            kind = hlo_source.ring_kind(ins.rest)
        if kind == "all-gather":
            labels[name] = "gathered parameters"
        elif kind in ("reduce-scatter", "all-reduce"):
            labels[name] = "gradients"
        elif _phase(ins.rest) in ("engine", "unknown") and not oh.holds(ins, comps):
            found = {labels[o] for o in ins.operands if o in labels}
            if len(found) == 1:
                labels[name] = found.pop()
    return labels


@dataclass
class Breakdown:
    parts: Dict[str, int]
    peak: int                  # libtpu's peak the parts are set against
    live_peak: int             # the heap's live bytes at their most
    peak_instruction: str      # where that happens
    curve: List[Tuple[str, int]]  # (instruction, HBM in use) in schedule order
    before_backward: int = 0   # the curve's most before the backward's first matmul (what sits beside the loss)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def as_dict(self) -> dict:
        return {"parts": dict(self.parts), "peak": self.peak, "sum": self.total, "live_peak": self.live_peak,
                "peak_instruction": self.peak_instruction, "before_backward": self.before_backward,
                "curve_peak": max((v for _, v in self.curve), default=0), "unattributed": self.peak - self.total}


def parameter_kinds(traced_text: str, tensors: List[dict]) -> Dict[int, str]:
    """Entry parameter number -> what the job holds in it: the kind of a listed tensor of its dtype and shape."""
    wanted: Dict[Tuple[str, Tuple[int, ...]], List[str]] = {}
    for t in tensors:
        key = (TORCH_DTYPES.get(t["dtype"].replace("torch.", ""), t["dtype"]), tuple(t["shape"]))
        wanted.setdefault(key, []).append(t["kind"])
    for kinds in wanted.values():  # parameters first, then optimizer state, then gradients
        kinds.sort(key=lambda k: ARGUMENT_KINDS.index(k) if k in ARGUMENT_KINDS else len(ARGUMENT_KINDS))
    out: Dict[int, str] = {}
    params = [ins for ins in oh.computations(traced_text).get("ENTRY", []) if ins.opcode == "parameter"]
    for ins in sorted(params, key=lambda i: int(i.rest.split(")", 1)[0])):
        array = _ARRAY.match(ins.shape)
        key = (array.group(1), tuple(int(d) for d in array.group(2).split(",") if d)) if array else None
        kinds = wanted.get(key)
        out[int(ins.rest.split(")", 1)[0])] = kinds.pop(0) if kinds else "other inputs"
    return out


def _slots(ba: bam.BufferAssignment, heap, at: Dict[str, int]) -> List[Tuple[int, int, int, bam.Value]]:
    """The heap's live ranges (start, end, bytes, the largest value) in schedule positions. Values at one offset of
    one allocation whose lives overlap (a loop's value and its next iteration's) are one buffer, counted once."""
    by_slot: Dict[Tuple[int, int], List[Tuple[int, int, bam.Value]]] = {}
    for a in heap:
        for vid in a.values:
            v = ba.values[vid]
            start = at.get(v.instruction)
            if start is None:
                continue
            ends = [at[x] for x in v.uses + v.positions if x in at]
            by_slot.setdefault((a.index, v.offset), []).append((start, max(ends + [start]), v))
    out = []
    for spans in by_slot.values():
        spans.sort(key=lambda s: s[0])
        start, end, big = spans[0]
        for s, e, v in spans[1:]:
            if s <= end:  # overlapping lives in one buffer: one range, the larger value
                end, big = max(end, e), (v if v.size > big.size else big)
            else:
                out.append((start, end, big.size, big))
                start, end, big = s, e, v
        out.append((start, end, big.size, big))
    return out


def _output_writes(ba: bam.BufferAssignment, outputs, order: List[str]) -> Dict[int, int]:
    """Schedule position -> bytes of the output allocations whose returned value (the one the entry's root reads) is
    made there."""
    root = order[-1] if order else ""
    at = {name: i for i, name in enumerate(order)}
    out: Dict[int, int] = {}
    for a in outputs:
        values = [ba.values[v] for v in a.values if ba.values[v].instruction in at]
        returned = [v for v in values if root in v.positions or v.instruction == root] or values
        if returned:
            position = max(at[v.instruction] for v in returned)
            out[position] = out.get(position, 0) + a.size
    return out


def breakdown(ba: bam.BufferAssignment, optimized: str, memory: dict,
              kinds: Optional[Dict[int, str]] = None, comps=None) -> Breakdown:
    """Split `memory`'s peak (report.hbm_account's dict, libtpu's figures) by the buffer assignment `ba` of the
    program `optimized`; `kinds`: entry parameter number -> ARGUMENT_KINDS or "other inputs"; `comps`:
    `optimized_hlo.computations(optimized)` when the caller has it."""
    kinds = kinds or {}
    comps = comps if comps is not None else oh.computations(optimized)
    order = schedule(optimized, comps)
    at = {name: i for i, name in enumerate(order)}
    instrs = {ins.name: ins for body in comps.values() for ins in body}
    parts = dict.fromkeys(PARTS, 0)
    for number, size in bam.parameter_sizes(ba).items():
        parts[kinds.get(number, "other inputs")] += size
    outputs = [a for a in ba.allocations if a.kind == "output" and a.color == bam.HBM]
    parts["outputs"] = sum(a.size for a in outputs)
    heap = ba.of_kind("temp")
    heap_bytes = sum(a.size for a in heap)

    slots = _slots(ba, heap, at)
    events: Dict[int, int] = {}
    for start, end, size, _ in slots:
        events[start] = events.get(start, 0) + size
        events[end + 1] = events.get(end + 1, 0) - size
    live = list(itertools.accumulate(events.get(i, 0) for i in range(len(order))))  # the heap's live bytes
    best = max([0] + live)
    best_at = live.index(best) if best > 0 else 0
    labels = _collective_labels(order, instrs, comps)
    backward_from = _backward_from(order, instrs, comps)
    for start, end, size, v in slots:
        if start <= best_at <= end:
            parts[_classify(v, (start, end), instrs, comps, labels, backward_from)] += size
    # what the heap holds beyond its live bytes (negative: the liveness overcounts, shown rather than hidden)
    parts["heap fragmentation"] = heap_bytes - best
    # the rest of libtpu's program figure: its code, constants and overlays
    parts["code and overlays"] = memory["libtpu_program"] - heap_bytes
    fixed = sum(parts[k] for k in ARGUMENT_KINDS + ("other inputs",)) + parts["code and overlays"]
    written = _output_writes(ba, outputs, order)
    curve, made = [], 0
    for i, name in enumerate(order):
        made += written.get(i, 0)
        curve.append((name, fixed + made + live[i]))
    before = max((v for _, v in curve[:backward_from]), default=0)
    return Breakdown(parts, int(memory["peak"]), best, order[best_at] if order else "", curve, before)


def _classify(v: bam.Value, span: Tuple[int, int], instrs, comps, labels: Dict[str, str],
              backward_from: int) -> str:
    ins = instrs.get(v.instruction)
    if ins is None:
        return "temporaries"
    if v.instruction in labels:
        return labels[v.instruction]
    readers = [instrs[u] for u in v.uses if u in instrs]
    if any(labels.get(r.name) == "gradients" and oh._collective_kind(r, comps) for r in readers):
        return "gradients"  # what a reduction reads: a gradient before it is reduced
    if span[0] < backward_from <= span[1]:
        return "activations"  # made before the backward starts, read by it (a scanned forward's stacks too)
    return "temporaries"


def _backward_from(order: List[str], instrs, comps) -> int:
    """The schedule position of the backward's first matmul (len(order): none); not its first instruction, as libtpu
    hoists what depends only on the inputs (the loss gradient's label mask) to the step's top."""
    for i, name in enumerate(order):
        ins = instrs.get(name)
        if ins is not None and _phase(ins.rest) == "backward" and oh.holds(ins, comps):
            return i
    return len(order)
