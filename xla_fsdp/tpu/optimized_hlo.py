"""Reading the TPU-optimized program: its collectives, in the order the chip runs them.

libtpu's optimized module is scheduled: the entry computation's instructions appear in execution order. A
collective is synchronous when it is one instruction (`all-gather`, `all-reduce`, ..., or a fusion wrapping one);
asynchronous when it is a start/done pair (`all-gather-start` / `all-gather-done`, `async-start` / `async-done`, or
libtpu's own `async-collective-start` / `async-collective-done` fusions), and then the instructions scheduled
between start and done run beside it. Bytes are the largest buffer the collective touches (an all-gather's output,
a reduce-scatter's input, an all-reduce's operand).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
               "s4": 1, "u4": 1}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "collective-broadcast", "ragged-all-to-all")
# libtpu fuses the steps of an asynchronous collective into the compute scheduled beside it
_CONTINUATION = "async_collective_fusion"
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_DIMS = re.compile(r"\[([0-9,]*)\]")
MATMULS = ("convolution", "dot")


def shape_bytes(shape: str) -> List[int]:
    """Bytes of every array in an HLO shape string (a tuple gives several)."""
    return [math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
            for dtype, dims in _ARRAY.findall(shape) if dtype in DTYPE_BYTES]


def group(pattern, text: str) -> str:
    """The first group of `pattern`'s first match in `text` ("" when it does not match)."""
    m = re.search(pattern, text)
    return m.group(1) if m else ""


def dims(shape: str) -> List[int]:
    """The dimensions of the first array in an HLO shape string."""
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    rest: str

    @property
    def operands(self) -> List[str]:
        head = self.rest.split(")", 1)[0]
        return re.findall(r"%([\w.\-]+)", head)

    @property
    def called(self) -> str:
        """The computation it calls (`calls=`; "" when none)."""
        return group(_CALLS, self.rest)


@dataclass
class Collective:
    """One collective of the optimized program."""

    kind: str
    name: str
    bytes: int
    asynchronous: bool
    position: int
    beside: int = 0          # instructions scheduled between start and done
    beside_matmuls: int = 0  # of which fusions holding a matmul (convolution / dot)
    beside_compute: int = 0  # of which compute (fusions, matmuls; no collectives or copies)
    beside_names: List[str] = field(default_factory=list)
    group_size: int = 0       # devices in one replica group (0: every device of the program)
    done_position: int = -1   # where an asynchronous one is waited for

    def as_dict(self) -> dict:
        d = asdict(self)
        d["beside_names"] = d["beside_names"][:8]
        return d


def computations(text: str) -> Dict[str, List[Instruction]]:
    """Every computation's instructions, by computation name; the entry is under "ENTRY"."""
    out: Dict[str, List[Instruction]] = {}
    current: Optional[List[Instruction]] = None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", stripped)
            if m and not stripped.startswith("HloModule"):
                current = out.setdefault("ENTRY" if m.group(1) else m.group(2), [])
            continue
        if stripped == "}" or stripped.startswith("}, execution_thread="):  # host computations (offload)
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            current.append(Instruction(m.group(1), m.group(2), m.group(3), m.group(4)))
    return out


# [Note: libtpu's reduce-scatter emitter]
# libtpu writes a large reduce-scatter as a kCustom fusion named `all-reduce-scatter` holding an all-reduce of the
# whole buffer and a dynamic slice of this device's rows. Its backend config names the collective emitter:
# SingleInputAllReduceScatterFusion, the one libtpu gives the reduce-scatters it keeps as `reduce-scatter`
# instructions (all-reduces get RotatedPincerEmitter and ring strategies). So a collective whose emitter is a
# reduce-scatter emitter counts as a reduce-scatter ((n-1)/n of its input sent), whatever its instructions say. An
# all-reduce at the top level whose result a later instruction slices (`scatters_as_all_reduce`) is a real
# all-reduce and counts twice that (tests/test_tpu_compiler.py, test_large_reduce_scatter_is_read_as_one).
_EMITTER = re.compile(r'"emitter":"(\w+)"')


def emitter(ins: Instruction) -> str:
    """The collective emitter libtpu chose for this instruction ("" when none is named)."""
    return group(_EMITTER, ins.rest)


def _collective_kind(ins: Instruction, comps: Dict[str, List[Instruction]]) -> Optional[str]:
    """The collective an instruction is (or wraps), else None."""
    if "ReduceScatter" in emitter(ins):  # [Note: libtpu's reduce-scatter emitter]
        return "reduce-scatter"
    op = ins.opcode
    for kind in KINDS:
        if op in (kind, kind + "-start"):
            return kind
    if op in ("fusion", "async-start", "custom-call", "call"):
        if ins.called.startswith(_CONTINUATION):
            return None  # compute that carries an open collective's next step: work beside it
        for inner in comps.get(ins.called, []):
            kind = _collective_kind(inner, comps)
            if kind:
                return kind
        for kind in KINDS:  # libtpu names collective fusions after what they hold
            if kind in ins.name and "done" not in ins.name:
                return kind
    return None


_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


def _group_size(ins: Instruction, comps: Dict[str, List[Instruction]], depth: int = 0) -> int:
    """Devices in the first replica group, looking into what it calls; 0: every device, or not found."""
    m = _GROUPS_LIST.search(ins.rest)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _GROUPS_IOTA.search(ins.rest)
    if m:
        return int(m.group(2))
    if depth < 4:
        for inner in comps.get(ins.called, []):
            if _collective_kind(inner, comps):
                n = _group_size(inner, comps, depth + 1)
                if n:
                    return n
    return 0


def program_devices(text: str) -> int:
    """Devices one program runs on: its replica count times its partition count (header)."""
    header = text.split("\n", 1)[0]
    return int(group(r"replica_count=(\d+)", header) or 1) * int(group(r"num_partitions=(\d+)", header) or 1)


def _is_start(ins: Instruction) -> bool:  # any -start, async-start included, or libtpu's async-collective-start
    return ins.opcode.endswith("-start") or "collective-start" in ins.name


def _is_done(ins: Instruction) -> bool:
    return ins.opcode.endswith("-done") or "collective-done" in ins.name


def holds(ins: Instruction, comps: Dict[str, List[Instruction]], opcodes=MATMULS) -> bool:
    """Whether `ins` is one of `opcodes` (default a matmul) or calls a computation holding one."""
    return ins.opcode in opcodes or any(i.opcode in opcodes for i in comps.get(ins.called, []))


# [Note: collectives inside While loops]
# A scanned model (scan_layers) compiles to a While loop whose body gathers one layer's parameters and
# reduce-scatters its gradients. The body is scheduled on its own, so its collectives are read like the entry's and
# counted once per trip. torch_xla's scan writes no known_trip_count; its condition compares the loop counter
# (tuple element 0) with a constant, which is the trip count.
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
_BODY_OF = re.compile(r"body=%?([\w.\-]+)")
_CONSTANT = re.compile(r"constant\((-?\d+)\)")


def trip_count(ins: Instruction, comps: Dict[str, List[Instruction]]) -> Optional[int]:
    """How many times a `while` instruction runs its body, or None when the program does not say."""
    known = _TRIP_COUNT.search(ins.rest)
    if known:
        return int(known.group(1))
    inner = comps.get(group(_CONDITION, ins.rest), [])
    constants = {i.name: int(m.group(1)) for i in inner if i.opcode == "constant"
                 for m in [_CONSTANT.search(i.opcode + "(" + i.rest)] if m}
    bounds = [constants[o] for i in inner if i.opcode == "compare" and "direction=LT" in i.rest
              for o in i.operands if o in constants]
    return max(bounds) if bounds else None


def loop_body(ins: Instruction) -> str:
    """The body computation's name of a `while` instruction ("" when it names none)."""
    return group(_BODY_OF, ins.rest)


def while_loops(text: str) -> List[dict]:
    """The entry computation's While loops: body, trip count (None: unknown) and position."""
    comps = computations(text)
    return [{"name": ins.name, "body": loop_body(ins), "trip_count": trip_count(ins, comps), "position": pos}
            for pos, ins in enumerate(comps.get("ENTRY", [])) if ins.opcode == "while"]


def all_collectives(text: str) -> List[Collective]:
    """The entry's collectives, then every While body's once per trip (once when the trip count is unknown)."""
    found = collectives(text)
    for loop in while_loops(text):
        inner = collectives(text, loop["body"])
        found.extend(c for _ in range(loop["trip_count"] or 1) for c in inner)
    return found


def collectives(text: str, computation: str = "ENTRY") -> List[Collective]:
    """One computation's collectives (default the entry's) in schedule order, each marked synchronous or
    asynchronous, with the work scheduled beside the asynchronous ones. A done is paired with its start through
    data: libtpu's done fusions read the start's buffers through get-tuple-elements and the compute fusions it
    threads them through, so every instruction carries the set of open starts it depends on."""
    comps = computations(text)
    entry = comps.get(computation, [])
    shapes = {ins.name: ins.shape for ins in entry}
    out: List[Collective] = []
    open_starts: Dict[str, Collective] = {}
    depends: Dict[str, set] = {}
    for pos, ins in enumerate(entry):
        deps = set()
        for operand in ins.operands:
            deps |= depends.get(operand, set())
        deps &= set(open_starts)
        if _is_done(ins):
            for name in deps:
                started = open_starts.pop(name)
                between = entry[started.position + 1:pos]
                real = [i for i in between if i.opcode not in _BOOKKEEPING]
                started.beside = len(real)
                started.beside_matmuls = sum(holds(i, comps) for i in real)
                started.beside_compute = sum(i.opcode in _COMPUTE and not _is_start(i) and not _is_done(i)
                                             and _collective_kind(i, comps) is None for i in real)
                started.beside_names = [i.name for i in real if holds(i, comps)]
                started.done_position = pos
            continue
        kind = _collective_kind(ins, comps)
        if kind is None:
            if deps:
                depends[ins.name] = deps
            continue
        sizes = shape_bytes(ins.shape) + [b for o in ins.operands for b in shape_bytes(shapes.get(o, ""))]
        c = Collective(kind, ins.name, max(sizes, default=0), _is_start(ins), pos,
                       group_size=_group_size(ins, comps))
        out.append(c)
        if c.asynchronous:
            open_starts[ins.name] = c
            depends[ins.name] = {ins.name}
    return out


_COMPUTE = ("fusion", "convolution", "dot")
_BOOKKEEPING = ("bitcast", "get-tuple-element", "tuple", "constant", "parameter", "copy-start", "copy-done")


def ring_bytes(c: Collective, devices: int) -> float:
    """Bytes one chip sends for `c` on a ring of its replica group (`devices`: every device): all-gather (n-1)/n of its
    result, reduce-scatter (n-1)/n of its operand, all-reduce 2(n-1)/n, all-to-all (n-1)/n, a permute all of it."""
    n = c.group_size or devices
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(c.kind, (n - 1) / n) * c.bytes


def summarize(found: List[Collective], devices: int = 0) -> dict:
    """Counts and bytes by kind, sync vs async, and the async bytes with a matmul beside them; with `devices`, also the
    bytes each chip sends on a ring (`ring_bytes`), in all and asynchronously with a matmul beside."""
    by_kind: Dict[str, dict] = {}
    for c in found:
        k = by_kind.setdefault(c.kind, {"sync": 0, "async": 0, "bytes": 0, "async_bytes": 0,
                                        "async_with_matmul": 0})
        k["bytes"] += c.bytes
        k["async" if c.asynchronous else "sync"] += 1
        if c.asynchronous:
            k["async_bytes"] += c.bytes
            k["async_with_matmul"] += int(c.beside_matmuls > 0)
    total = sum(c.bytes for c in found)
    overlapped = sum(c.bytes for c in found if c.asynchronous and c.beside_matmuls > 0)
    out = {"by_kind": by_kind, "count": len(found), "sync": sum(not c.asynchronous for c in found),
           "async": sum(c.asynchronous for c in found), "bytes": total,
           "async_bytes_with_matmul_fraction": (overlapped / total) if total else 0.0,
           "async_bytes_fraction": (sum(c.bytes for c in found if c.asynchronous) / total) if total else 0.0}
    for k in by_kind.values():
        k["async_bytes_fraction"] = (k["async_bytes"] / k["bytes"]) if k["bytes"] else 0.0
    if devices:
        sent = sum(ring_bytes(c, devices) for c in found)
        beside = sum(ring_bytes(c, devices) for c in found if c.asynchronous and c.beside_matmuls > 0)
        computing = sum(ring_bytes(c, devices) for c in found if c.asynchronous and c.beside_compute > 0)
        for c in found:
            k = by_kind[c.kind]
            k["sent"] = k.get("sent", 0.0) + ring_bytes(c, devices)
        out.update(sent_per_chip=sent, sent_async_with_matmul_fraction=(beside / sent) if sent else 0.0,
                   sent_async_with_compute_fraction=(computing / sent) if sent else 0.0)
    return out


@dataclass
class ScatterHeld:
    """A reduce-scatter libtpu compiled as an all-reduce of the whole buffer, and how long its result stays live."""

    name: str
    bytes: int
    held_for: int  # schedule positions from the all-reduce to its last user


def scatters_as_all_reduce(text: str) -> List[ScatterHeld]:
    """The entry computation's all-reduces that stand for a reduce-scatter (a user cuts this device's rows out of
    the result with a dynamic slice), with how long their full-size results stay live ([Note: materialize the
    scattered shard] in collective_engine/param_group.py keeps that to a few instructions)."""
    comps = computations(text)
    entry = comps.get("ENTRY", [])
    users: Dict[str, List[int]] = {}
    for pos, ins in enumerate(entry):
        for operand in ins.operands:
            users.setdefault(operand, []).append(pos)
    out = []
    for pos, ins in enumerate(entry):
        after = users.get(ins.name, [])
        if ins.opcode == "all-reduce" and any(holds(entry[u], comps, ("dynamic-slice",)) for u in after):
            out.append(ScatterHeld(ins.name, max(shape_bytes(ins.shape), default=0), max(after) - pos))
    return out


def operand_names(rest: str) -> List[str]:
    """The operands of an instruction, from the text after its opcode's "(" (shapes printed inline with tiled
    layouts hold parentheses of their own, so the list ends at the matching ")")."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            if depth == 0:
                return re.findall(r"%([\w.\-]+)", rest[:i])
            depth -= 1
    return re.findall(r"%([\w.\-]+)", rest)
