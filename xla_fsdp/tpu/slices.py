"""Cloud TPU slices as users name them (v4-8, v5e-256, v5litepod-16, ...): chips, hosts, topology, chip facts.

Accelerator types count TensorCores for v4 and v5p (two per chip, one
"megacore" device each) and chips for v5e and v6e. Hosts hold 4 chips,
except the single-host v5e-8 / v6e-8 (8 chips on one host). The topology
names and create options are what libtpu's `PJRT_TopologyDescription_Create`
takes (the same MaxText's train_compile.py passes through JAX).

Chip figures, per chip (Cloud TPU docs pages named in `source`): HBM
capacity and bandwidth, peak dense bf16 FLOP/s, and the one-way bandwidth of
one ICI link (the JAX scaling book's table) with the number of links.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

GIB = 1024 ** 3


@dataclass(frozen=True)
class Chip:
    generation: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float
    ici_link_one_way: float
    ici_links: int
    megacore: bool
    source: str


CHIPS: Dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, 32 GiB HBM2 at 1200 GBps; 3-D torus, 6 links
    "v4": Chip("v4", 32 * GIB, 1200e9, 275e12, 4.5e10, 6, True, "cloud.google.com/tpu/docs/v4; jax-ml scaling book"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 16 GB HBM2 at 819 GBps; 2-D torus, 1600 Gbps ICI (4 links)
    "v5e": Chip("v5e", 16 * GIB, 819e9, 197e12, 5e10, 4, False, "cloud.google.com/tpu/docs/v5e; jax-ml scaling book"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GB HBM2e at 2765 GBps; 4800 Gbps ICI (6 links)
    "v5p": Chip("v5p", 95 * 10 ** 9, 2765e9, 459e12, 1e11, 6, True, "cloud.google.com/tpu/docs/v5p; jax-ml scaling book"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GB HBM at 1640 GBps; 3584 Gbps ICI (4 links)
    "v6e": Chip("v6e", 32 * 10 ** 9, 1640e9, 918e12, 1e11, 4, False, "cloud.google.com/tpu/docs/v6e; jax-ml scaling book"),
}

# chips -> topology shape
_CUBE = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
         256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
_PLANE = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e"}


@dataclass(frozen=True)
class SliceSpec:
    """One Cloud TPU slice: what the compiler needs, and what the report compares with."""

    name: str
    chip: Chip
    chips: int
    hosts: int
    topology_name: str
    options: Dict[str, object] = field(hash=False, compare=False)

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes


def known_types() -> Tuple[str, ...]:
    """Every accelerator type this module accepts."""
    out = [f"v4-{2 * c}" for c in _CUBE if c <= 2048] + [f"v5p-{2 * c}" for c in _CUBE]
    out += [f"v5e-{c}" for c in _PLANE] + [f"v6e-{c}" for c in _PLANE]
    return tuple(out)


def parse_accelerator_type(text: str) -> SliceSpec:
    """"v4-8" (or "v5litepod-16", "v5e-8", ...) -> its SliceSpec; unknown types list the known ones."""
    name = text.strip().lower()
    gen, _, count = name.partition("-")
    gen = _ALIASES.get(gen, gen)
    if gen not in CHIPS or not count.isdigit():
        raise ValueError(f"unknown TPU accelerator type {text!r}; known: {', '.join(known_types())}")
    chip, n = CHIPS[gen], int(count)
    if chip.megacore:  # the type counts TensorCores, two per chip
        chips = n // 2
        if n % 2 or chips not in _CUBE or (gen == "v4" and chips > 2048):
            raise ValueError(f"unknown TPU accelerator type {text!r}; known: {', '.join(known_types())}")
        dims = _CUBE[chips]
        wrap = [d >= 4 and chips >= 64 for d in dims]  # full cubes of 4x4x4 and up are tori
        options = {"chip_config_name": "megacore", "chips_per_host_bounds": [2, 2, 1], "num_slices": 1,
                   "wrap": [int(w) for w in wrap]}
        hosts = max(chips // 4, 1)
    else:
        chips = n
        if chips not in _PLANE:
            raise ValueError(f"unknown TPU accelerator type {text!r}; known: {', '.join(known_types())}")
        dims = _PLANE[chips]
        single_host = chips <= 8
        bounds = [dims[0], dims[1], 1] if single_host else [2, 2, 1]
        options = {"chip_config_name": "default", "chips_per_host_bounds": bounds, "num_slices": 1,
                   "wrap": [0, 0, 0]}
        hosts = 1 if single_host else chips // 4
    topology = f"{gen}:{'x'.join(str(d) for d in dims)}"
    return SliceSpec(f"{gen}-{n}", chip, chips, hosts, topology, options)
