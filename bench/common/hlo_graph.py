"""The dependency graph of an HLO module's entry computation, for overlap and liveness questions.

A collective can run while a matmul runs only if neither depends on the
other: `independent_flops(c)` is the matmul work that is neither an ancestor
nor a descendant of collective `c`. A gather with no matmul among its
ancestors could be scheduled at the very start of the step ("hoistable").
Used by tests/test_overlap.py, tests/test_fsdp2_program.py, bench/overlap.py and bench/project_tpu.py.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.+?)\s+([a-z][a-z0-9-]*)\((.*)$")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_WIDTH = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "s64": 8, "f64": 8, "u8": 1, "pred": 1, "s8": 1, "u32": 4}


def _dims(text: str) -> List[int]:
    return [int(d) for d in text.split(",") if d]


@dataclass
class Instr:
    name: str
    opcode: str
    dtype: str
    shape: List[int]
    operands: List[str]
    attrs: str
    operand_shapes: List[List[int]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * _WIDTH.get(self.dtype, 4)

    @property
    def flops(self) -> float:
        """2 x output elements x contracted size for a dot (the matmul work); 0 otherwise."""
        if self.opcode != "dot" or not self.operand_shapes:
            return 0.0
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", self.attrs)
        lhs = self.operand_shapes[0]
        contracted = math.prod(lhs[d] for d in _dims(m.group(1))) if m else 1
        return 2.0 * math.prod(self.shape) * contracted


class HloGraph:
    """The entry computation of one HLO module (text as torch_xla prints it)."""

    def __init__(self, text: str):
        entry = text[text.index("ENTRY"):]
        body = entry[entry.index("{") + 1:]
        self.instrs: Dict[str, Instr] = {}
        self.order: List[str] = []
        for line in body.splitlines():
            m = _LINE.match(line)
            if not m:
                continue
            name, result, opcode, rest = m.groups()
            shape = _SHAPE.search(result)
            args_text = rest.split("),")[0]
            operands = re.findall(r"%([\w.\-]+)", args_text)
            operand_shapes = [_dims(d) for _, d in _SHAPE.findall(args_text)]
            self.instrs[name] = Instr(name, opcode, shape.group(1) if shape else "f32",
                                      _dims(shape.group(2)) if shape else [], operands, rest, operand_shapes)
            self.order.append(name)
        self.users: Dict[str, List[str]] = {n: [] for n in self.instrs}
        for n, ins in self.instrs.items():
            ins.operands = [o for o in ins.operands if o in self.instrs]
            for o in ins.operands:
                self.users[o].append(n)
        self._anc: Dict[str, Set[str]] = {}
        self.total_flops = sum(i.flops for i in self.instrs.values())

    def ancestors(self, name: str) -> Set[str]:
        if name not in self._anc:
            seen, stack = set(), list(self.instrs[name].operands)
            while stack:
                n = stack.pop()
                if n not in seen:
                    seen.add(n)
                    stack.extend(self.instrs[n].operands)
            self._anc[name] = seen
        return self._anc[name]

    def descendants(self, name: str) -> Set[str]:
        seen, stack = set(), list(self.users[name])
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(self.users[n])
        return seen

    def collectives(self, kinds=COLLECTIVES) -> List[Instr]:
        return [self.instrs[n] for n in self.order if self.instrs[n].opcode in kinds]

    def independent_flops(self, name: str) -> float:
        related = self.ancestors(name) | self.descendants(name)
        return sum(i.flops for n, i in self.instrs.items() if i.opcode == "dot" and n not in related)

    def before_every_matmul(self, name: str) -> bool:
        """Every matmul of the program depends on `name`, so no schedule of this program can run
        one beside it: its time is exposed by construction (the step's first gathers)."""
        desc = self.descendants(name)
        dots = [n for n, i in self.instrs.items() if i.opcode == "dot"]
        return bool(dots) and all(n in desc for n in dots)

    def hoistable(self, name: str) -> bool:
        return not any(self.instrs[a].opcode == "dot" for a in self.ancestors(name))

    def comm_bytes(self, ins: Instr, world: int) -> float:
        """Bytes one rank sends on a ring for this collective."""
        frac = (world - 1) / world
        if ins.opcode == "all-gather":
            return frac * ins.bytes
        if ins.opcode == "reduce-scatter":
            return frac * ins.bytes * world
        return 2 * frac * ins.bytes

    def uses_done_before(self, producer: str, consumer: str) -> bool:
        """Every use of `producer` is an ancestor of `consumer` (so it is dead when `consumer` runs)."""
        anc = self.ancestors(consumer)
        return all(u in anc for u in self.users[producer])

    def pieces(self, name: str) -> List[str]:
        """The per-parameter cuts of a gathered buffer: slices of it, through reshapes."""
        out, stack = [], [name]
        while stack:
            for u in self.users[stack.pop()]:
                op = self.instrs[u].opcode
                if op in ("reshape", "bitcast"):
                    stack.append(u)
                elif op == "slice":
                    out.append(u)
        return out

    def bytes_in_use_at(self, producer: str, consumer: str) -> int:
        """Bytes of `producer`'s pieces that still have a use when `consumer` runs (a use that
        is not an ancestor of it)."""
        anc = self.ancestors(consumer)
        return sum(self.instrs[p].bytes for p in self.pieces(producer)
                   if not all(u in anc for u in self.users[p]))

    def first_dot_after(self, name: str) -> Optional[str]:
        return next((n for n in self.order if self.instrs[n].opcode == "dot" and name in self.ancestors(n)), None)


# --- used by bench/project_tpu.py (appended; nothing above depends on it) ---------------------

def result_bytes(text: str) -> Dict[str, int]:
    """Bytes of every entry instruction's result, tuple elements summed (`Instr.bytes` counts
    only the first element of a tuple)."""
    entry = text[text.index("ENTRY"):]
    out: Dict[str, int] = {}
    for line in entry[entry.index("{") + 1:].splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(1)] = sum(math.prod(_dims(d)) * _WIDTH.get(t, 4) for t, d in _SHAPE.findall(m.group(2)))
    return out


def dot_flops(graph: "HloGraph", ins: Instr) -> float:
    """`Instr.flops`, taking the lhs shape from its producer when the text omits operand shapes
    (XLA's own dumps, e.g. the partitioned program, print `dot(%a, %b)`)."""
    if ins.opcode != "dot":
        return 0.0
    if ins.operand_shapes:
        return ins.flops
    lhs = graph.instrs[ins.operands[0]].shape if ins.operands else []
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    contracted = math.prod(lhs[d] for d in _dims(m.group(1))) if m and lhs else 1
    return 2.0 * math.prod(ins.shape) * contracted
