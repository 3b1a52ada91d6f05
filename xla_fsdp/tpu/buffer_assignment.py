"""libtpu's buffer assignment of a compiled program, read from the file it dumps.

[Note: libtpu's buffer assignment]
Given `xla_dump_to=DIR` as a compile option (`env_option_overrides`, a string; no TPU needed), libtpu 0.0.21 writes
`module_*.after_optimizations-buffer-assignment.txt`: every allocation with its size and kind, and its HLO values:

    allocation 1: size 65536, parameter 1, shape |f32[128,128]| at ShapeIndex {}:
     value: <22 param.1 @0> (size=65536,offset=0): f32[128,128]{1,0:T(8,128)}
    allocation 16: size 102400, color 3, preallocated-temp:
     value: <21 ag.1 @3> (size=16384,offset=81920): f32[32,128]{1,0:T(8,128)S(3)}

then, under "Used values:", each value's positions (the instructions it appears at) and uses (`name, operand i`).
Kinds: `parameter N` (entry argument N), `maybe-live-out` (an output), `preallocated-temp` (the heap of
temporaries, one per memory space), `constant`, `thread-local` (a reducer's scalars). `color N` is the memory
space: 0 (none printed) is HBM; the others (S(1), S(2), S(3), S(6)) are on-core memories and semaphores, which do
not count against HBM. Sizes are padded to the chip's tiles.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

HBM = 0
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):\s*$")
_VALUE = re.compile(r"^ value: <(\d+) ([^\s{>]+)(\{[\d,]*\})?(?: \(phi\))?(?: @(\d+))?> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")
_USED = re.compile(r"^<(\d+) ([^\s{>]+)(\{[\d,]*\})?(?: \(phi\))?(?: @(\d+))?>\s*$")
_PARAMETER = re.compile(r"parameter (\d+)")
_COLOR = re.compile(r"color (\d+)")
SUFFIX = "after_optimizations-buffer-assignment.txt"


@dataclass
class Value:
    id: int
    instruction: str          # the instruction that defines it
    index: str                # its shape index in that instruction's result ("" for the whole)
    color: int
    size: int
    offset: int = 0
    allocation: int = -1
    positions: List[str] = field(default_factory=list)  # instructions it appears at (tuples, aliases)
    uses: List[str] = field(default_factory=list)       # instructions that read it


@dataclass
class Allocation:
    index: int
    size: int
    color: int
    parameter: Optional[int]  # the entry parameter it holds, if any
    live_out: bool
    kind: str                 # "parameter", "temp", "output", "constant", "thread-local", "other"
    values: List[int] = field(default_factory=list)


@dataclass
class BufferAssignment:
    allocations: List[Allocation]
    values: Dict[int, Value]

    def of_kind(self, kind: str, color: int = HBM) -> List[Allocation]:
        return [a for a in self.allocations if a.kind == kind and a.color == color]


def _kind(flags: str, parameter: Optional[int], live_out: bool) -> str:
    if parameter is not None:
        return "parameter"
    if "preallocated-temp" in flags:
        return "temp"
    if live_out:
        return "output"
    if "constant" in flags:
        return "constant"
    if "thread-local" in flags:
        return "thread-local"
    return "other"


def parse(text: str) -> BufferAssignment:
    """The dump's text -> allocations and values (with positions and uses)."""
    allocations: List[Allocation] = []
    values: Dict[int, Value] = {}
    lines = text.splitlines()
    used = next((i for i, line in enumerate(lines) if line.startswith("Used values:")), len(lines))
    for line in lines[:used]:
        m = _ALLOCATION.match(line)
        if m:
            flags = m.group(3)
            p = _PARAMETER.search(flags)
            c = _COLOR.search(flags)
            parameter = int(p.group(1)) if p else None
            live_out = "maybe-live-out" in flags
            allocations.append(Allocation(int(m.group(1)), int(m.group(2)), int(c.group(1)) if c else HBM,
                                          parameter, live_out, _kind(flags, parameter, live_out)))
        else:
            v = _VALUE.match(line)
            if v and allocations:
                value = Value(int(v.group(1)), v.group(2), (v.group(3) or "").strip("{}"), int(v.group(4) or HBM),
                              int(v.group(5)), int(v.group(6)), allocations[-1].index)
                values[value.id] = value
                allocations[-1].values.append(value.id)
    current: Optional[Value] = None
    section = ""
    for line in lines[used + 1:]:
        m = _USED.match(line)
        if m:
            current = values.get(int(m.group(1)))
            section = ""
            continue
        if current is None:
            continue
        stripped = line.strip()
        if stripped in ("positions:", "uses:"):
            section = stripped[:-1]
        elif stripped.startswith("from instruction:"):
            section = ""
        elif stripped and section == "positions":
            current.positions.append(stripped.split()[0])
        elif stripped and section == "uses":
            current.uses.append(stripped.split(",")[0])
    return BufferAssignment(allocations, values)


def find(folder: str) -> Optional[str]:
    """The largest buffer-assignment dump in `folder` (the step's module; None when there is none)."""
    found = glob.glob(os.path.join(folder, "*" + SUFFIX))
    return max(found, key=os.path.getsize) if found else None


def read(folder: str) -> Optional[BufferAssignment]:
    path = find(folder)
    return None if path is None else read_file(path)


def read_file(path: str) -> BufferAssignment:
    with open(path) as f:
        return parse(f.read())


def parameter_sizes(ba: BufferAssignment) -> Dict[int, int]:
    """Entry parameter number -> the HBM its allocation takes (a tuple parameter: the sum of its parts)."""
    out: Dict[int, int] = {}
    for a in ba.allocations:
        if a.kind == "parameter" and a.color == HBM:
            out[a.parameter] = out.get(a.parameter, 0) + a.size
    return out
