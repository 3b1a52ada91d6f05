"""A PROJECTED step time read off the TPU's own schedule (libtpu's optimized program).

Nothing here is measured on a TPU. The optimized module's entry computation lists its instructions in the order
the chip runs them; this walks that order on two clocks, the TensorCore's and the ICI's:
- a compute instruction (a fusion, a lone dot / convolution, a copy, ...) takes its roofline time, max(FLOPs /
  peak bf16 FLOP/s, HBM bytes / HBM bandwidth), FLOPs from the dots and convolutions it holds (f32 operands at
  HIGH / HIGHEST precision take 3 / 6 bf16 passes), bytes from its operands and result (an operand it only slices
  counts as the slice; a result that updates a slice of a buffer in place counts as the update);
- a synchronous collective starts when the core and the ICI are both free, and the core waits for it;
- an asynchronous one starts on the ICI when the core reaches its start (or when the ICI frees up) and runs beside
  the instructions scheduled until its done, where the core waits for it if it has not finished;
- a collective costs a latency plus the bytes one chip sends on a bidirectional ring of its replica group
  (`optimized_hlo.ring_bytes`) at 2 x one ICI link's one-way bandwidth; on a torus, a collective over every chip
  sends on 2 links per wrapped axis ([Note: links per collective]);
- libtpu's `AllocateBuffer` writes nothing and costs nothing;
- a Pallas kernel (`tpu_custom_call`) is never free: its FLOPs and HBM bytes are charged at a stated share of MXU
  peak (`kernel_mxu_share`, default 0.5; [Note: charging Pallas kernels] in kernel_cost.py).
The projection is the core's clock at the end. Not modeled: launch and host overheads, HBM contention between a
collective and the compute beside it, VMEM reuse, how libtpu routes a collective over part of a torus. Chip figures
come from `xla_fsdp.tpu.chips`. Every projection is printed with its calibration against a measured step (the
blog's FSDPv1 2B on v4-8, 4.191 s): `calibrated()`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from xla_fsdp.tpu import host_transfers, kernel_cost
from xla_fsdp.tpu.fusion_bytes import fusion_bytes
from xla_fsdp.tpu.optimized_hlo import operand_names
from xla_fsdp.tpu import optimized_hlo as oh

# measured / projected for the one TPU step we have a measurement of: the blog's torch_xla FSDPv1 GPT-2 2B on v4-8
# (32 x 1024 per chip, Adafactor, per-layer checkpointing, eager attention) took 4.191 s; this model projects that
# program (bench/anchor_job.py, libtpu 0.0.21) at 3.543 s (bench/results/calibration_2b_v4-8_2026-11-27.json).
# The blog's other FSDPv1 steps check this ratio (docs/performance.md, "The blog's table, compiled").
CALIBRATION_RATIO = 4.191 / 3.5425  # 1.183
CALIBRATION_SOURCE = "blog FSDPv1 2B v4-8, eager attention: measured 4.191 s / projected 3.543 s"
COLLECTIVE_LATENCY_S = 10e-6  # per collective; an assumption, no published figure
RING_LINKS = 2                # a bidirectional ring sends on two links at once
F32_PASSES = {"default": 1, "high": 3, "highest": 6}
# [Note: prefetches off the core]
# libtpu's memory-space assignment moves buffers between HBM and the chip's alternate memory (S(3)) with
# asynchronous DMAs the core does not wait on: copy-start/copy-done, and "sliced prefetches", a copy cut into
# slice-start/slice-done pairs. The model charges neither to the core's timeline (charging each slice-start as a
# serial read of its whole operand added 110 ms to a 2B v4-8 step, for 15.5 GB actually moved).
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done",
         "slice-start", "slice-done",
         "after-all", "opt-barrier", "partition-id", "replica-id", "add-dependency", "iota")
# libtpu's uninitialized buffer (a loop's output stack: [Note: the loop's output buffers] in
# collective_engine/region_loop.py) is an allocation: nothing is written, no cycles estimated
ALLOCATE = 'custom_call_target="AllocateBuffer"'
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_LABELS = re.compile(r"dim_labels=([^_\s,]+)_([^-\s,]+)->")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


# [Note: links per collective]
# A chip has 6 ICI links on v4 (4 on v5e/v6e). A bidirectional ring along one axis uses 2 of them, and that is what
# the model charges on a mesh: v4 slices below 64 chips have no wraparound links, and the 2-link ring is what the
# calibration point and the blog's 16B on v4-64 agree with (model error -0.2%). v4 slices of whole 4x4x4 cubes are
# tori (`topology.py` builds them with wrap), and a collective over the whole torus can run rings along every
# wrapped axis at once: 2 links per axis, 6 on v4-128 and up (measured: the blog's FSDPv1 steps from 20B on v4-128
# to 128B on v4-512 within -4% to +11% at 6 links, +27% to +50% off at 2; bench/results/blog_pairs_2026-11-26.json).
# A collective over part of the slice (our per-axis reduce-scatters, sharding groups) keeps 2: which axes its group
# spans is not read from the program. So does a collective-permute (each chip sends to one neighbour).


@dataclass
class StepEstimate:
    """A projection (never a measurement) of one step on one chip."""

    seconds: float              # the core's clock at the end of the step
    compute_seconds: float      # the core's busy time (the step if communication were free)
    sync_collective_seconds: float
    async_collective_seconds: float
    exposed_async_seconds: float  # time the core waited at a done
    flops: float
    hbm_bytes: float
    chip: str
    kernel_calls: int = 0         # Pallas kernels (tpu_custom_call) charged, whose FLOPs are in `flops`
    kernel_flops: float = 0.0
    kernel_seconds: float = 0.0   # their share of compute_seconds
    kernel_mxu_share: float = kernel_cost.DEFAULT_MXU_SHARE
    kernels_without_flops: int = 0  # kernels charged their bytes only (unknown kind, no cost estimate)

    @property
    def exposed_seconds(self) -> float:
        return self.seconds - self.compute_seconds

    def as_dict(self) -> dict:
        return {"projected_seconds": self.seconds, "compute_seconds": self.compute_seconds,
                "sync_collective_seconds": self.sync_collective_seconds,
                "async_collective_seconds": self.async_collective_seconds,
                "exposed_async_seconds": self.exposed_async_seconds, "flops": self.flops,
                "hbm_bytes": self.hbm_bytes, "chip": self.chip, "label": "projection",
                "kernel_calls": self.kernel_calls, "kernel_flops": self.kernel_flops,
                "kernel_seconds": self.kernel_seconds, "kernel_mxu_share": self.kernel_mxu_share,
                "kernels_without_flops": self.kernels_without_flops,
                "calibrated_seconds": self.seconds * CALIBRATION_RATIO, "calibration_ratio": CALIBRATION_RATIO}


def _window_taps(rest: str, lhs_labels: str, lhs: List[int]) -> int:
    """Input positions one output of a convolution reads per input feature. In each spatial dimension the window
    spans `size` positions, of which only every lhs_dilate-th is an input and at most the input's own extent are not
    padding (XLA writes batched and outer-product matmuls as convolutions whose windows are mostly dilation or
    padding: `window={size=768 stride=767 lhs_dilate=768}`, `window={size=1x24 pad=0_0x23_23}`)."""
    m = _WINDOW.search(rest)
    if not m:
        return 1
    fields = dict(f.split("=", 1) for f in m.group(1).split() if "=" in f)
    sizes = [int(x) for x in fields.get("size", "").split("x") if x]
    dilate = [int(x) for x in fields.get("lhs_dilate", "").split("x") if x] or [1] * len(sizes)
    extent = {int(label): size for label, size in zip(lhs_labels, lhs) if label.isdigit()} \
        if len(lhs_labels) == len(lhs) else {}
    return math.prod(min(-(-s // d), extent.get(i, s)) for i, (s, d) in enumerate(zip(sizes, dilate)))


def _matmul_flops(ins: oh.Instruction, shapes: Dict[str, str]) -> float:
    """FLOPs of one dot or convolution (multiply-adds x 2), in bf16 passes."""
    out = math.prod(oh.dims(ins.shape))
    ops = operand_names(ins.rest)
    lhs = oh.dims(shapes.get(ops[0], "")) if ops else []
    if ins.opcode == "dot":
        m = _CONTRACT.search(ins.rest)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if (m and lhs) else 1
    else:  # convolution: contracted size = the kernel's input features x the window's real taps
        rhs = oh.dims(shapes.get(ops[1], "")) if len(ops) > 1 else []
        m = _LABELS.search(ins.rest)
        k = 1
        if m and rhs and len(m.group(2)) == len(rhs):
            k = math.prod(size for label, size in zip(m.group(2), rhs) if label == "i") * \
                _window_taps(ins.rest, m.group(1), lhs)
    flops = 2.0 * out * k
    operand_dtype = shapes.get(ops[0], "") if ops else ""
    if operand_dtype.startswith("f32"):
        low = ins.rest.lower()
        passes = F32_PASSES["highest"] if "highest" in low else F32_PASSES["high"] if "=high" in low or \
            "{high" in low or ",high" in low else F32_PASSES["default"]
        flops *= passes
    return flops


def _computation_flops(name: str, comps, depth: int = 0) -> float:
    if depth > 8:
        return 0.0
    body = comps.get(name, [])
    shapes = {i.name: i.shape for i in body}
    total = 0.0
    for ins in body:
        if ins.opcode in ("dot", "convolution"):
            total += _matmul_flops(ins, shapes)
        else:
            for called in re.findall(r"(?:calls|body|to_apply)=%?([\w.\-]+)", ins.rest):
                if ins.opcode in ("reduce", "reduce-window", "scatter", "sort", "map", "select-and-scatter",
                                  "all-reduce", "reduce-scatter"):
                    continue  # scalar combiners
                total += _computation_flops(called, comps, depth + 1)
    return total


def _compute_cost(ins: oh.Instruction, entry_shapes, comps, chip, depth: int = 0,
                  mxu_share: float = kernel_cost.DEFAULT_MXU_SHARE, kernels: Optional[list] = None
                  ) -> Tuple[float, float, float]:
    """(seconds, FLOPs, HBM bytes) of one entry compute instruction; Pallas kernels met are appended to `kernels`."""
    op = ins.opcode
    if op in _FREE or (op == "custom-call" and ALLOCATE in ins.rest) or host_transfers.is_move(ins):
        return 0.0, 0.0, 0.0  # a host move is a DMA beside the core: its PCIe lane is charged in host_transfers
    if kernel_cost.is_pallas(ins):
        k = kernel_cost.cost(ins, entry_shapes)
        if kernels is not None:
            kernels.append(k)
        return k.seconds(chip, mxu_share), k.flops, k.hbm_bytes
    if op == "while":
        body = oh.loop_body(ins)
        n = oh.trip_count(ins, comps) or 1
        secs = flops = moved = 0.0
        if body and depth < 4:
            inner = comps.get(body, [])
            shapes = {i.name: i.shape for i in inner}
            found: list = []
            for i in inner:
                s, f, b = _compute_cost(i, shapes, comps, chip, depth + 1, mxu_share, found)
                secs, flops, moved = secs + s, flops + f, moved + b
            if kernels is not None:
                kernels.extend(found * n)
        return secs * n, flops * n, moved * n
    if op in ("fusion", "call", "custom-call"):
        flops = _computation_flops(ins.called, comps)
        moved = fusion_bytes(ins, entry_shapes, comps)
    else:
        flops = _matmul_flops(ins, entry_shapes) if op in oh.MATMULS else 0.0
        moved = sum(sum(oh.shape_bytes(entry_shapes.get(o, ""))) for o in operand_names(ins.rest)) + \
            sum(oh.shape_bytes(ins.shape))
    secs = max(flops / chip.peak_bf16_flops, moved / chip.hbm_bytes_per_s)
    return secs, flops, moved


def links(c: oh.Collective, devices: int, torus_axes: int = 0) -> int:
    """ICI links one chip sends `c`'s bytes on ([Note: links per collective])."""
    whole_slice = c.group_size in (0, devices) and c.kind != "collective-permute"  # a permute: one neighbour
    return RING_LINKS * torus_axes if torus_axes and whole_slice else RING_LINKS


def collective_seconds(c: oh.Collective, devices: int, chip, torus_axes: int = 0) -> float:
    """Latency + ring bytes one chip sends / (its `links` x one ICI link one way)."""
    sent = oh.ring_bytes(c, devices)
    return COLLECTIVE_LATENCY_S + sent / (links(c, devices, torus_axes) * chip.ici_link_one_way) if sent else 0.0


@dataclass
class Event:
    """One span of the projected step (seconds): `lane` "compute" or a collective's kind; a collective's `start`-`end`
    runs from the core issuing it to the core having its result, `ici_*` its ICI transfer."""

    lane: str
    name: str
    start: float
    end: float
    asynchronous: bool = False
    ici_start: float = 0.0
    ici_end: float = 0.0
    trip: int = -1  # the While loop's trip it belongs to (-1: not in a loop)

    def shifted(self, by: float, trip: int) -> "Event":
        return Event(self.lane, self.name, self.start + by, self.end + by, self.asynchronous,
                     self.ici_start + by, self.ici_end + by, trip if self.trip < 0 else self.trip)


def _walk(text: str, name: str, comps, chip, devices: int, torus_axes: int, mxu_share: float,
          kernels: list, depth: int = 0, events: Optional[list] = None) -> Tuple[float, ...]:
    """One scheduled computation on the chip's timeline: (core's clock at the end, compute, sync, async, exposed
    seconds, FLOPs, HBM bytes), a While loop its body times its trips; `events` gets its `Event`s."""
    instrs = comps.get(name, [])
    shapes = {i.name: i.shape for i in instrs}
    found = oh.collectives(text, name)
    at = {c.position: c for c in found}
    waits: Dict[int, List[oh.Collective]] = {}
    for c in found:
        if c.asynchronous and c.done_position >= 0:
            waits.setdefault(c.done_position, []).append(c)
    core = ici = compute = sync = asynchronous = exposed = flops = moved = 0.0
    finish: Dict[str, float] = {}
    issued: Dict[str, Event] = {}
    for pos, ins in enumerate(instrs):
        if pos in waits:
            ready = max(finish.pop(c.name, 0.0) for c in waits[pos])
            if ready > core:
                exposed += ready - core
                core = ready
            for c in waits[pos]:
                if c.name in issued:
                    issued.pop(c.name).end = core
            continue
        c = at.get(pos)
        if c is not None:
            cost, begin = collective_seconds(c, devices, chip, torus_axes), max(core, ici)
            if c.asynchronous:
                ici = finish[c.name] = begin + cost
                asynchronous += cost
                if events is not None:
                    issued[c.name] = Event(c.kind, c.name, core, ici, True, begin, ici)
                    events.append(issued[c.name])
            else:
                core = ici = begin + cost
                sync += cost
                if events is not None:
                    events.append(Event(c.kind, c.name, begin, core, False, begin, core))
            continue
        if oh._is_done(ins):
            continue  # an unpaired done (its start not recognized): nothing to wait for
        if ins.opcode == "while" and depth < 4:
            n = oh.trip_count(ins, comps) or 1
            inner: list = []
            body_events: Optional[list] = [] if events is not None else None
            parts = _walk(text, oh.loop_body(ins), comps, chip, devices, torus_axes,
                          mxu_share, inner, depth + 1, body_events)
            kernels.extend(inner * n)
            begin = max(core, ici)
            if events is not None:
                for trip in range(n):
                    events.extend(e.shifted(begin + trip * parts[0], trip) for e in body_events)
            core = ici = begin + n * parts[0]
            compute, sync, asynchronous, exposed, flops, moved = (
                a + n * b for a, b in zip((compute, sync, asynchronous, exposed, flops, moved), parts[1:]))
            continue
        secs, f, b = _compute_cost(ins, shapes, comps, chip, mxu_share=mxu_share, kernels=kernels)
        if events is not None and secs > 0:
            events.append(Event("compute", ins.name, core, core + secs))
        core += secs
        compute += secs
        flops += f
        moved += b
    if finish:  # still open at the end: the computation ends when they land
        core = max(core, *finish.values())
    return core, compute, sync, asynchronous, exposed, flops, moved


def estimate(text: str, chip, devices: Optional[int] = None, torus_axes: int = 0,
             kernel_mxu_share: float = kernel_cost.DEFAULT_MXU_SHARE, events: Optional[list] = None
             ) -> StepEstimate:
    """Walk the optimized program `text` (libtpu's) on `chip` (`xla_fsdp.tpu.chips.Chip`); `torus_axes`: the slice's
    axes that wrap around (`SliceSpec.torus_axes`; 0 for a mesh); `kernel_mxu_share`: the share of MXU peak Pallas
    kernels are charged at; `events`, when given, receives every `Event` of the projected step in schedule order."""
    if not 0 < kernel_mxu_share <= 1:
        raise ValueError(f"kernel_mxu_share must be in (0, 1], got {kernel_mxu_share}")
    comps = oh.computations(text)
    devices = devices or oh.program_devices(text)
    kernels: list = []
    core, compute, sync, asynchronous, exposed, flops, moved = _walk(
        text, "ENTRY", comps, chip, devices, torus_axes, kernel_mxu_share, kernels, events=events)
    return StepEstimate(core, compute, sync, asynchronous, exposed, flops, moved, chip.generation,
                        kernel_calls=len(kernels), kernel_flops=sum(k.flops for k in kernels),
                        kernel_seconds=sum(k.seconds(chip, kernel_mxu_share) for k in kernels),
                        kernel_mxu_share=kernel_mxu_share,
                        kernels_without_flops=sum(1 for k in kernels if not k.flops_known))


def calibrated(projected: float, reference_projected: float, reference_measured: float) -> Tuple[float, float]:
    """(ratio measured / projected of the reference, `projected` scaled by it)."""
    ratio = reference_measured / reference_projected
    return ratio, projected * ratio
