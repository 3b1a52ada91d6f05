"""The TPU slices bench/overlap.py and bench/project_tpu.py project a traced program onto.

Nothing here is a figure of its own: each chip's peak, HBM and ICI link come
from the chip table (`xla_fsdp.tpu.chips`, every figure with its source), the
slice's chips and shape from `xla_fsdp.tpu.topology`, and the collective model
from `xla_fsdp.tpu.step_time`: a ring collective over the slice runs as a
bidirectional ring along a cycle through every chip (a 2x2, 2x4 or 2x2x2
slice has one), so each chip sends on two links at once, ring bandwidth =
2 x one-way link bandwidth, plus a fixed latency per collective. A 3D slice
could drive more links with a multi-dimensional algorithm; that is not
modeled here (conservative).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from xla_fsdp.tpu import step_time, topology
from xla_fsdp.tpu.chips import GIB


@dataclass(frozen=True)
class TpuSlice:
    name: str
    chips: int
    topology: str
    peak_bf16_flops: float      # dense bf16 matmul FLOP/s per chip
    hbm_bytes_per_s: float      # HBM bandwidth per chip
    hbm_gib: float              # HBM capacity per chip
    ici_link_one_way: float     # bytes/s, one direction of one ICI link
    ring_links: int = step_time.RING_LINKS  # links a chip sends on in the modeled ring
    collective_latency_s: float = step_time.COLLECTIVE_LATENCY_S  # an assumption, no published figure
    sources: str = ""

    @property
    def ici_ring_bytes_per_s(self) -> float:
        return self.ring_links * self.ici_link_one_way


def _slice(name: str) -> TpuSlice:
    spec = topology.parse_accelerator_type(name)
    chip = spec.chip
    return TpuSlice(name, chips=spec.chips, topology="x".join(map(str, spec.shape)),
                    peak_bf16_flops=chip.peak_bf16_flops, hbm_bytes_per_s=chip.hbm_bytes_per_s,
                    hbm_gib=chip.hbm_bytes / GIB, ici_link_one_way=chip.ici_link_one_way, sources=chip.source)


SLICES: Dict[str, TpuSlice] = {name: _slice(name) for name in ("v4-8", "v5e-8", "v5p-8")}

# f32 matmuls at DEFAULT / HIGH / HIGHEST precision as bf16 passes (xla_fsdp.tpu.step_time)
F32_PASSES = step_time.F32_PASSES

ALIASES = {"v5litepod-8": "v5e-8"}


def get(name: str) -> TpuSlice:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in SLICES:
        raise SystemExit(f"unknown TPU {name!r}; known: {', '.join(sorted(SLICES))}")
    return SLICES[key]
