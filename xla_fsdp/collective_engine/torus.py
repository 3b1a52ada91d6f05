"""The reduce-scatter split by the TPU slice's torus axes ([Note: one reduce-scatter per torus axis]).

[Note: one reduce-scatter per torus axis]
On v4 slices libtpu compiles many of our reduce-scatters over the whole slice as an all-reduce of the whole buffer plus
a slice: twice the bytes (every one on slices spanning three ICI axes; many on v4-8). A reduce-scatter whose group lies
along ONE axis stays a reduce-scatter (tests/test_tpu_large_slice.py). So on these slices the single controller reduces
in stages, one per axis, slowest-varying first: on a 2x2x4 slice (device id = x + 2y + 4z) a reduce-scatter over each
z-line of 4 chips leaves each chip a quarter of the buffer, one over each y-pair halves that, one over each x-pair
halves it again. Rank r = (z, y, x) ends with chunk z*4 + y*2 + x = r summed over all 16 chips, the flat
reduce-scatter's result, and each chip sends 3/4 + 1/8 + 1/16 = 15/16 of the buffer, the ring's (N-1)/N.

Applied by `reduce_scatter_stages="axes"` (and by "auto" where rings do not apply: [Note: rings by default on a TPU] in
auto.py) only where it is known to be right and to pay: the single controller, one shard group of every device of the
slice in device-id order, a slice spanning at least two ICI axes. "flat" turns it off.

[Note: staged on 2-D slices]
On 2-D slices (v5e, v6e) too. v6e-8 keeps its flat 2-D reduce-scatters ([Note: 2-D reduce-scatter] in collectives.py;
the default rings them there anyway), but on v6e-256 (16 x 16) libtpu compiles every flat one as a synchronous
all-reduce plus a slice; staged, one per 16-chip line, they stay reduce-scatters (measured: a 2-layer Llama 3 8B copy
3.6% shorter and faster to compile; the 32-layer program in docs/performance.md). The reduce-scatter rings of 3-D pods
([Note: reduce-scatter rings on pods] in auto.py) stay off 2-D slices, where they compiled slower for less. v5e/v6e
slices of 16 to 128 chips were not compiled staged.

The slice's shape comes from the torus variable (`environment.TORUS`: "2x2x4", x first; "16x16" for a 2-D slice; the
ahead-of-time check sets it) or, on a TPU, from the runtime's device coordinates.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from ..runtime import environment


ENV = environment.TORUS

Stage = Tuple[List[List[int]], int]  # (replica groups as device ids, devices per group)


def parse(text: str) -> Tuple[int, ...]:
    """"2x2x4" -> (2, 2, 4): devices along x, y, z (x varies fastest in device ids)."""
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(v < 1 for v in shape):
        raise ValueError(f"{ENV}={text!r}: expected the slice's devices per axis, x first, like 2x2x4")
    return shape


def from_coordinates(coords: Sequence[Sequence[int]]) -> Optional[Tuple[int, ...]]:
    """The slice's shape when device i sits at coordinates (x, y, z) with i = x + X*(y + Y*z), one device per chip; None
    for any other numbering (e.g. two cores per chip)."""
    if not coords or any(len(c) != len(coords[0]) for c in coords):
        return None
    shape = tuple(max(c[a] for c in coords) + 1 for a in range(len(coords[0])))
    if math.prod(shape) != len(coords):
        return None
    expect = [[(i // math.prod(shape[:a])) % size for a, size in enumerate(shape)] for i in range(len(coords))]
    return shape if all(list(c) == e for c, e in zip(coords, expect)) else None


def slice_shape() -> Optional[Tuple[int, ...]]:
    """The shape of the slice this process drives, if it is known."""
    given = environment.get(ENV)
    if given:
        return parse(given)
    try:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return None
        kind = xm.xla_device_kind().lower()
        plane = not ("v4" in kind or ("v5" in kind and "lite" not in kind and "v5e" not in kind))
        attributes = xr.global_runtime_device_attributes()
    except Exception:  # no runtime, or a torch_xla without these: reduce-scatter flat
        return None
    coords = [tuple(a.get("coords", ())) for a in attributes]
    from ..runtime.slices import slice_groups

    coords = [coords[d] for d in slice_groups(len(coords), attributes)[0]]  # one slice's chips
    if plane:  # 2-D ICI (v5e, v6e): x and y; a third coordinate, if given, is 0 on every chip
        if any(len(c) < 2 or any(c[2:]) for c in coords):
            return None
        coords = [c[:2] for c in coords]
    return from_coordinates(coords)


def each_slice(one: List[Stage], slices: int, per_slice: int) -> List[Stage]:
    """The stages of one slice (device ids 0 to per_slice - 1) run in every slice of a multislice job at once: each
    stage's groups repeated with each slice's first device id added ([Note: HSDP across slices]). Flat, libtpu kept
    them synchronous (64B on 2 x v4-256: 0.67 of the ICI bytes asynchronous against 0.97; docs/pods.md)."""
    return [([[d + s * per_slice for d in g] for s in range(slices) for g in groups], count)
            for groups, count in one]


def three_axes(shape: Optional[Tuple[int, ...]]) -> bool:
    """A slice of 3-D ICI (v4, v5p: three numbers, "2x2x4"), where reduce-scatter rings were measured."""
    return shape is not None and len(shape) == 3


def stages(group: Sequence[int], shape: Optional[Tuple[int, ...]], mode: str = "auto") -> List[Stage]:
    """The reduce-scatter stages for one shard group holding every device, or [] for one flat reduce-scatter. Each stage
    lists its replica groups (device ids in rank order)."""
    from ..options import REDUCE_SCATTER_STAGES  # options loads torch; the check's own process reads ENV only

    if mode not in REDUCE_SCATTER_STAGES:
        raise ValueError(f"reduce_scatter_stages={mode!r}: use one of {REDUCE_SCATTER_STAGES}")
    if mode not in ("auto", "axes") or shape is None or sum(size > 1 for size in shape) < 2:
        return []
    n = math.prod(shape)
    if list(group) != list(range(n)):
        return []
    # the slowest-varying axis first; device id = x + X*(y + Y*z)
    axes = [(shape[axis], math.prod(shape[:axis])) for axis in reversed(range(len(shape)))]
    return [([[base + k * step for k in range(size)] for base in range(n) if (base // step) % size == 0], size)
            for size, step in axes if size > 1]
