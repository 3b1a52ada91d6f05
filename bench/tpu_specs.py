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

V4_DOCS = "https://cloud.google.com/tpu/docs/v4"
V5E_DOCS = "https://cloud.google.com/tpu/docs/v5e"
V5P_DOCS = "https://cloud.google.com/tpu/docs/v5p"

SLICES: Dict[str, TpuSlice] = {
    "v4-8": TpuSlice(
        "v4-8", chips=4, topology="2x2x1",
        # V4_DOCS: "Peak compute per chip 275 teraflops (bf16 or int8)"
        peak_bf16_flops=275e12,
        # V4_DOCS: "HBM2 capacity and bandwidth 32 GiB, 1200 GBps"
        hbm_bytes_per_s=1200e9, hbm_gib=32,
        # SCALING_BOOK, TPU v4p row: 4.5e10 bytes/s one-way per link (the v4 docs page gives no ICI figure)
        ici_link_one_way=4.5e10,
        sources=f"{V4_DOCS}; {SCALING_BOOK}"),
    "v5e-8": TpuSlice(
        "v5e-8", chips=8, topology="2x4",
        # V5E_DOCS: "Peak compute per chip (bf16) 197 TFLOPs"
        peak_bf16_flops=197e12,
        # V5E_DOCS: "HBM2 capacity and bandwidth 16 GB, 819 GBps"
        hbm_bytes_per_s=819e9, hbm_gib=16,
        # SCALING_BOOK, TPU v5e row: 5e10 bytes/s one-way per link (V5E_DOCS: "Interchip Interconnect BW
        # 1600 Gbps" per chip, i.e. 4 links x 50 GB/s)
        ici_link_one_way=5e10,
        sources=f"{V5E_DOCS}; {SCALING_BOOK}"),
    "v5p-8": TpuSlice(
        "v5p-8", chips=4, topology="2x2x1",
        # V5P_DOCS: "Peak compute per chip (bf16) 459 TFLOPs"
        peak_bf16_flops=459e12,
        # V5P_DOCS: "HBM2e capacity and bandwidth 95GB, 2765 GBps"
        hbm_bytes_per_s=2765e9, hbm_gib=95,
        # SCALING_BOOK, TPU v5p row: 1e11 bytes/s one-way per link (V5P_DOCS: "Interchip Interconnect BW
        # 4800 Gbps" per chip, i.e. 6 links x 100 GB/s)
        ici_link_one_way=1e11,
        sources=f"{V5P_DOCS}; {SCALING_BOOK}"),
}

# TPUs run f32 matmuls at DEFAULT precision as one bf16 pass ("By default, TPUs perform matrix
# multiplication operations with bfloat16 values and accumulations with IEEE float32 values":
# https://cloud.google.com/tpu/docs/bfloat16); HIGH and HIGHEST take 3 and 6 bf16 passes
# (bf16_3x / bf16_6x: https://docs.jax.dev/en/latest/201/precision.html).
F32_PASSES = {"default": 1, "high": 3, "highest": 6}


ALIASES = {"v5litepod-8": "v5e-8"}


def get(name: str) -> TpuSlice:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in SLICES:
        raise SystemExit(f"unknown TPU {name!r}; known: {', '.join(sorted(SLICES))}")
    return SLICES[key]
