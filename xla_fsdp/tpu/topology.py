"""Cloud TPU accelerator types as users type them ("v4-8", "v5e-16", "v5litepod-8") -> slices.

A slice says what libtpu's `PJRT_TopologyDescription_Create` needs (topology name and create options, the names
JAX's `get_topology_desc` passes through) and what a report compares a program with (chips, hosts, chip figures).
Counting, as in Cloud TPU accelerator types:
- v4-N and v5p-N count TensorCores, two per chip: N/2 chips on a 3-D torus, four per host. The two cores act as
  one "megacore" device, so libtpu reports one device per chip. Slices of 64 chips and more are whole 4x4x4
  cubes and wrap around in every dimension (V4_DOCS).
- v5e-N and v6e-N count chips on a 2-D grid. Up to 8 chips sit on one host (one VM); larger slices run one VM,
  i.e. one process, per 4 chips (V5E_DOCS, V6E_DOCS tables). We pass no wraparound for these.
`chips_per_host_bounds` sets how libtpu splits devices over processes; its default for "v5e:2x4" is two processes
of 4, not the single 8-chip VM, so we always pass it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple

from xla_fsdp.tpu.chips import CHIPS, Chip

# chips -> the 3-D slice shape Cloud TPU allocates (v4 and v5p)
_CUBE_SHAPES: Dict[int, Tuple[int, int, int]] = {
    4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
    256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16)}
# chips -> the 2-D slice shape (v5e and v6e, up to the 256-chip pod)
_PLANE_SHAPES: Dict[int, Tuple[int, int]] = {
    1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e"}
_CHIPS_PER_VM = 4           # multi-host slices: one VM (one process) per 4 chips
_MAX_SINGLE_HOST_CHIPS = 8  # v5e-8 / v6e-8: one VM holds all 8


@dataclass(frozen=True)
class SliceSpec:
    """One Cloud TPU slice."""

    name: str                   # canonical accelerator type, e.g. "v5e-8"
    generation: str             # "v4", "v5e", "v5p", "v6e"
    chips: int
    hosts: int                  # TPU VMs, i.e. processes of a multi-process job
    shape: Tuple[int, ...]      # chips along each torus / grid dimension
    topology_name: str          # libtpu's name, e.g. "v5e:2x4"
    options: Mapping[str, object] = field(compare=False, hash=False)  # topology create options
    chip: Chip = field(compare=False, hash=False)
    slices: int = 1             # Multislice: this many such slices, joined over DCN ([Note: HSDP across slices])
    dcn_bytes_per_s: float = 0.0  # with slices: each chip's share of its host's DCN (0: the chip's figure)

    @property
    def devices(self) -> int:
        """Devices libtpu (and torch_xla) sees: one per chip (megacore chips are one device)."""
        return self.chips

    @property
    def job_chips(self) -> int:
        """Chips of the whole job: every slice's."""
        return self.chips * self.slices

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def hbm_bytes_per_chip(self) -> int:
        return self.chip.hbm_bytes

    @property
    def peak_bf16_flops_per_chip(self) -> float:
        return self.chip.peak_bf16_flops

    @property
    def hbm_bandwidth(self) -> float:
        """HBM bytes/s per chip."""
        return self.chip.hbm_bytes_per_s

    @property
    def torus_axes(self) -> int:
        """Axes longer than one chip whose ends are linked (wraparound): 3 on v4-128 and up."""
        wrap = self.options.get("wrap") or ()
        return sum(1 for w, n in zip(wrap, self.shape) if w and n > 1)

    @property
    def ici_bandwidth(self) -> float:
        """ICI bytes/s one chip can send over all its links at once (one direction)."""
        return self.chip.ici_bytes_per_s


def known_types() -> Tuple[str, ...]:
    """Every accelerator type `parse_accelerator_type` accepts, smallest first per generation."""
    return tuple(f"{generation}-{chips * 2 if chip.megacore else chips}" for generation, chip in CHIPS.items()
                 for chips in (_CUBE_SHAPES if chip.megacore else _PLANE_SHAPES))


def parse_accelerator_type(text: str) -> SliceSpec:
    """"v4-8", "v5e-16", "v5litepod-8", ... -> its SliceSpec; an unknown type raises ValueError naming the known."""
    generation, _, count = text.strip().lower().partition("-")
    generation = _ALIASES.get(generation, generation)
    chip = CHIPS.get(generation)
    if chip is None or not count.isdigit():
        raise _unknown(text)
    n = int(count)
    if chip.megacore:
        if n % 2 or n // 2 not in _CUBE_SHAPES:
            raise _unknown(text)
        chips = n // 2
        shape = _CUBE_SHAPES[chips]
        hosts = max(chips // _CHIPS_PER_VM, 1)
        wrap = [chips >= 64] * 3  # whole 4x4x4 cubes and up are tori
        options = {"chip_config_name": "megacore", "chips_per_host_bounds": [2, 2, 1]}
    else:
        if n not in _PLANE_SHAPES:
            raise _unknown(text)
        chips, shape = n, _PLANE_SHAPES[n]
        if chips <= _MAX_SINGLE_HOST_CHIPS:
            hosts, bounds = 1, [shape[0], shape[1], 1]
        else:
            hosts, bounds = chips // _CHIPS_PER_VM, [2, 2, 1]
        wrap = [False, False, False]
        options = {"chip_config_name": "default", "chips_per_host_bounds": bounds}
    options.update(num_slices=1, wrap=wrap)
    return SliceSpec(name=f"{generation}-{n}", generation=generation, chips=chips, hosts=hosts, shape=shape,
                     topology_name=f"{generation}:{'x'.join(map(str, shape))}", options=options, chip=chip)


def multislice(spec: SliceSpec, slices: int, dcn_gbps_per_host: Optional[float] = None) -> SliceSpec:
    """`slices` slices of `spec`'s type, joined over DCN: libtpu's topology option `num_slices` (slices x chips
    devices). `dcn_gbps_per_host`: the hosts' DCN bandwidth (Gbit/s) instead of the chip's figure."""
    if not isinstance(slices, int) or slices < 1:
        raise ValueError(f"--num_slices {slices!r}: expected a positive integer")
    if dcn_gbps_per_host is not None and not dcn_gbps_per_host > 0:
        raise ValueError(f"--dcn_gbps {dcn_gbps_per_host!r}: expected a positive bandwidth in Gbit/s per host")
    if slices == 1:
        return spec
    rate = dcn_gbps_per_host * 1e9 / 8 / spec.chips_per_host if dcn_gbps_per_host else spec.chip.dcn_bytes_per_s
    return replace(spec, slices=slices, name=f"{slices} x {spec.name}", dcn_bytes_per_s=rate,
                   options={**spec.options, "num_slices": slices})


def _unknown(text: str) -> ValueError:
    return ValueError(f"unknown TPU accelerator type {text!r}; known: {', '.join(known_types())} "
                      f"(v4 and v5p count TensorCores, two per chip; v5e and v6e count chips; "
                      f"v5litepod-N means v5e-N)")
