"""Published per-chip figures of Cloud TPU generations: HBM, peak bf16 FLOP/s, ICI.

The one table of chip facts: `xla_fsdp.metrics` (MFU peaks), the slice
topologies, the step-time model and bench/ read it. Each figure names its
source page. HBM capacity is kept in GiB (the docs print "GB"; what a program
can use on the chip is a little less, so a plan that fits with a margin is
what to aim at).
ICI: the one-way bandwidth of one link and the number of links per chip; the
docs give a per-chip total, which we split evenly over the chip's ports.
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
    # V4_DOCS: "Peak compute per chip 275 teraflops (bf16)", "HBM2 capacity and bandwidth 32 GiB,
    # 1200 GBps"; 3-D torus, 6 links. The v4 page gives no ICI figure: SCALING_BOOK, v4p row,
    # 4.5e10 bytes/s one way per link.
    # DCN: the v4 page gives none; assumed v5p's 50 Gbps per chip (4-chip hosts both; below).
    "v4": Chip("v4", "TPU v4", 32 * GIB, 1200e9, 275e12, 4.5e10, 6, True, f"{V4_DOCS}; {SCALING_BOOK}",
               dcn_bytes_per_s=50e9 / 8),
    # V5E_DOCS: "Peak compute per chip (bf16) 197 TFLOPs", "HBM2 capacity and bandwidth 16 GB,
    # 819 GBps", "Bidirectional ICI bandwidth (per chip) 400 GBps" = 4 ports x 50 GB/s each way.
    # DCN: V6E_DOCS's v5e column, "Per-host NIC configuration 2 x 100 Gbps NIC", "Chips per host 8".
    # Host DRAM: V6E_DOCS's v5e column, "DRAM per host 512 GiB", "Chips per host 8".
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 197e12, 5e10, 4, False, V5E_DOCS,
                dcn_bytes_per_s=2 * 100e9 / 8 / 8, host_dram_bytes_per_chip=512 * GIB // 8),
    # V5P_DOCS: "Peak compute per chip (bf16) 459 TFLOPs", "HBM2e capacity and bandwidth 95GB,
    # 2765 GBps", "Interchip Interconnect BW 4800 Gbps" = 6 links x 100 GB/s.
    # DCN: V5P_DOCS, "Data center network (DCN) bandwidth per chip (Gbps) 50".
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 2765e9, 459e12, 1e11, 6, True, V5P_DOCS, dcn_bytes_per_s=50e9 / 8),
    # V6E_DOCS: "Peak compute per chip (bf16) 918 TFLOPs", "HBM capacity per chip 32 GB",
    # "HBM bandwidth per chip 1640 GBps", "Bidirectional ICI bandwidth (per chip) 800 GBps" over
    # "ICI ports per chip 4" = 100 GB/s each way per port.
    # DCN: V6E_DOCS, "Per-host NIC configuration 4 x 200 Gbps NIC", "Chips per host 8".
    # Host DRAM: V6E_DOCS, "DRAM per host 1536 GiB", "Chips per host 8".
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 1640e9, 918e12, 1e11, 4, False, V6E_DOCS,
                dcn_bytes_per_s=4 * 200e9 / 8 / 8, host_dram_bytes_per_chip=1536 * GIB // 8),
}
