"""Published per-chip figures of Cloud TPU slices, for bench/project_tpu.py.

Every figure carries its source. ICI: the per-link one-way bandwidth from the
JAX scaling book's table; a ring collective over a slice is modeled as a
bidirectional ring along a cycle through every chip (a 2x2, 2x4 or 2x2x2
slice has one), so each chip sends on two links at once:
ring bandwidth = 2 x one-way link bandwidth. A 3D slice could drive more links
with a multi-dimensional algorithm; that is not modeled (conservative).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class TpuSlice:
    name: str
    chips: int
    topology: str
    peak_bf16_flops: float      # dense bf16 matmul FLOP/s per chip
    hbm_bytes_per_s: float      # HBM bandwidth per chip
    hbm_gib: float              # HBM capacity per chip
    ici_link_one_way: float     # bytes/s, one direction of one ICI link
    ring_links: int = 2         # links a chip sends on in the modeled ring
    collective_latency_s: float = 10e-6  # per collective; an assumption, no published figure
    sources: str = ""

    @property
    def ici_ring_bytes_per_s(self) -> float:
        return self.ring_links * self.ici_link_one_way


SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/ (ICI BW/link table)"

SLICES: Dict[str, TpuSlice] = {
    "v4-8": TpuSlice(
        "v4-8", chips=4, topology="2x2x1",
        peak_bf16_flops=275e12,   # "Peak compute per chip 275 teraflops (bf16 or int8)": https://cloud.google.com/tpu/docs/v4
        hbm_bytes_per_s=1200e9,   # "HBM2 capacity and bandwidth 32 GiB, 1200 GBps": https://cloud.google.com/tpu/docs/v4
        hbm_gib=32,               # same page
        ici_link_one_way=4.5e10,  # TPU v4p: 4.5e10 bytes/s one-way per link: https://jax-ml.github.io/scaling-book/tpus/
        sources="https://cloud.google.com/tpu/docs/v4; " + SCALING_BOOK),
    "v5e-8": TpuSlice(
        "v5e-8", chips=8, topology="2x4",
        peak_bf16_flops=197e12,   # "Peak compute per chip (bf16) 197 TFLOPs": https://cloud.google.com/tpu/docs/v5e
        hbm_bytes_per_s=819e9,    # "HBM2 capacity and bandwidth 16 GB, 819 GBps": https://cloud.google.com/tpu/docs/v5e
        hbm_gib=16,               # same page (16 GB)
        ici_link_one_way=5e10,    # TPU v5e: 5e10 bytes/s one-way per link: https://jax-ml.github.io/scaling-book/tpus/
        sources="https://cloud.google.com/tpu/docs/v5e; " + SCALING_BOOK),   # (docs: 1600 Gbps per chip = 4 links)
    "v5p-8": TpuSlice(
        "v5p-8", chips=4, topology="2x2x1",
        peak_bf16_flops=459e12,   # "Peak compute per chip (bf16) 459 TFLOPs": https://cloud.google.com/tpu/docs/v5p
        hbm_bytes_per_s=2765e9,   # "HBM2e capacity and bandwidth 95GB, 2765 GBps": https://cloud.google.com/tpu/docs/v5p
        hbm_gib=95,               # same page
        ici_link_one_way=1e11,    # TPU v5p: 1e11 bytes/s one-way per link: https://jax-ml.github.io/scaling-book/tpus/
        sources="https://cloud.google.com/tpu/docs/v5p; " + SCALING_BOOK),
}

# TPUs run f32 matmuls at DEFAULT precision as one bf16 pass ("By default, TPUs perform matrix
# multiplication operations with bfloat16 values and accumulations with IEEE float32 values":
# https://cloud.google.com/tpu/docs/bfloat16); HIGH and HIGHEST take 3 and 6 bf16 passes
# (bf16_3x / bf16_6x: https://docs.jax.dev/en/latest/201/precision.html).
F32_PASSES = {"default": 1, "high": 3, "highest": 6}


def get(name: str) -> TpuSlice:
    key = name.strip().lower()
    if key not in SLICES:
        raise SystemExit(f"unknown TPU {name!r}; known: {', '.join(sorted(SLICES))}")
    return SLICES[key]
