"""Published per-chip figures of Cloud TPU generations: HBM, peak bf16 FLOP/s, ICI.

The one table of chip facts: `xla_fsdp.metrics` (MFU peaks), the slice topologies, the step-time model and bench/
read it. Each figure names its source page. HBM capacity is kept in GiB (the docs print "GB"; a program can use a
little less, so aim at a plan that fits with a margin). ICI: the one-way bandwidth of one link and the links per
chip; the docs give a per-chip total, which we split evenly over the chip's ports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

GIB = 1024 ** 3

V4_DOCS = "cloud.google.com/tpu/docs/v4"
V5E_DOCS = "cloud.google.com/tpu/docs/v5e"
V5P_DOCS = "cloud.google.com/tpu/docs/v5p"
V6E_DOCS = "cloud.google.com/tpu/docs/v6e"
SCALING_BOOK = "jax-ml.github.io/scaling-book/tpus (ICI bandwidth per link table)"


@dataclass(frozen=True)
class Chip:
    """One TPU chip generation."""

    generation: str            # "v4", "v5e", "v5p", "v6e": the prefix of accelerator types
    device_kind: str           # what libtpu calls it (DeviceDescription kind)
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float     # dense bf16 matmul FLOP/s
    ici_link_one_way: float    # bytes/s, one direction of one ICI link
    ici_links: int             # ICI ports per chip
    megacore: bool             # two TensorCores driven as one device; accelerator types count cores
    source: str
    dcn_bytes_per_s: float = 0.0  # the chip's share of its host's data-center network (Multislice)
    host_dram_bytes_per_chip: int = 0  # the chip's share of its host's DRAM (host offload); 0: no cited figure

    @property
    def ici_bytes_per_s(self) -> float:
        """Bytes/s a chip can send over all its links at once (one direction)."""
        return self.ici_link_one_way * self.ici_links


CHIPS: Dict[str, Chip] = {
    # V4_DOCS: 275 TFLOPs bf16, HBM2 32 GiB at 1200 GBps; 3-D torus, 6 links. No ICI or DCN figure there: ICI from
    # SCALING_BOOK's v4p row (4.5e10 bytes/s one way per link), DCN assumed v5p's 50 Gbps per chip (4-chip hosts both).
    "v4": Chip("v4", "TPU v4", 32 * GIB, 1200e9, 275e12, 4.5e10, 6, True, f"{V4_DOCS}; {SCALING_BOOK}",
               dcn_bytes_per_s=50e9 / 8),
    # V5E_DOCS: 197 TFLOPs bf16, HBM2 16 GB at 819 GBps, bidirectional ICI 400 GBps per chip = 4 ports x 50 GB/s each
    # way. DCN and host DRAM: V6E_DOCS's v5e column, 2 x 100 Gbps NIC and 512 GiB DRAM per host of 8 chips.
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 197e12, 5e10, 4, False, V5E_DOCS,
                dcn_bytes_per_s=2 * 100e9 / 8 / 8, host_dram_bytes_per_chip=512 * GIB // 8),
    # V5P_DOCS: 459 TFLOPs bf16, HBM2e 95 GB at 2765 GBps, ICI 4800 Gbps = 6 links x 100 GB/s; DCN 50 Gbps per chip.
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 2765e9, 459e12, 1e11, 6, True, V5P_DOCS, dcn_bytes_per_s=50e9 / 8),
    # V6E_DOCS: 918 TFLOPs bf16, HBM 32 GB at 1640 GBps, bidirectional ICI 800 GBps per chip over 4 ports = 100 GB/s
    # each way per port; 4 x 200 Gbps NIC and 1536 GiB DRAM per host of 8 chips.
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 1640e9, 918e12, 1e11, 4, False, V6E_DOCS,
                dcn_bytes_per_s=4 * 200e9 / 8 / 8, host_dram_bytes_per_chip=1536 * GIB // 8),
}
