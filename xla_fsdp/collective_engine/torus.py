"""The reduce-scatter split by the TPU slice's torus axes ([Note: one reduce-scatter per torus axis]).

[Note: one reduce-scatter per torus axis]
On v4 slices libtpu 0.0.21 compiles many of our reduce-scatters over the whole slice as an
all-reduce of the whole buffer (its all-reduce emitter) plus a slice: twice the bytes. On slices
whose chips span three ICI axes (v4-32 and larger) every one; on v4-8 (2x2) 58 of the 97 of the
2B step, by what surrounds them (alone, the same buffer stays a reduce-scatter). A
reduce-scatter whose group lies along ONE axis stays a reduce-scatter (libtpu's reduce-scatter
emitter; tests/test_tpu_large_slice.py). So on these slices the single controller reduces in
stages, one per axis, slowest-varying first: on a 2x2x4 slice (device id = x + 2y + 4z) a
reduce-scatter over the 4 chips of each z-line leaves each chip a quarter of the buffer; one
over each y-pair halves that; one over each x-pair halves it again. Rank r = (z, y, x) ends
with chunk z*4 + y*2 + x = r summed over all 16 chips: the flat reduce-scatter's result. Bytes
each chip sends: 3/4 + 1/8 + 1/16 = 15/16 of the buffer, the ring reduce-scatter's (N-1)/N.

Applied by `reduce_scatter_stages="axes"` (and by "auto" where rings do not apply: [Note: rings
by default on a TPU] in auto.py) only where it is known to be right and to pay: the single
controller, one shard group that is every device of the slice in device-id order, a slice of
chips with 3-D ICI (v4, v5p) spanning at least two axes (compiled and measured on v4 only; v5p
by the same ICI shape, not compiled). v5e and v6e (2-D) keep their flat reduce-scatters, which
libtpu keeps. `reduce_scatter_stages="flat"` turns it off.

The slice's shape comes from `XLA_FSDP_TORUS` ("2x2x4", x first: the ahead-of-time check sets
it when it compiles for a v4 or v5p slice) or, on a v4/v5p TPU, from the runtime's device
coordinates.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence, Tuple

from ..options import REDUCE_SCATTER_STAGES

ENV = "XLA_FSDP_TORUS"

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
    """The slice's shape when device i sits at coordinates (x, y, z) with i = x + X*(y + Y*z),
    one device per chip; None for any other numbering (e.g. two cores per chip)."""
    if not coords or any(len(c) != len(coords[0]) for c in coords):
        return None
    shape = tuple(max(c[a] for c in coords) + 1 for a in range(len(coords[0])))
    if math.prod(shape) != len(coords):
        return None
    for i, c in enumerate(coords):
        rest, expect = i, []
        for size in shape:
            expect.append(rest % size)
            rest //= size
        if list(c) != expect:
            return None
    return shape


def slice_shape() -> Optional[Tuple[int, ...]]:
    """The shape of the slice this process drives, if it is known."""
    given = os.environ.get(ENV, "").strip()
    if given:
        return parse(given)
    try:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return None
        kind = xm.xla_device_kind().lower()
        if "v4" not in kind and not ("v5" in kind and "lite" not in kind and "v5e" not in kind):
            return None  # 2-D ICI (v5e, v6e): flat reduce-scatters stay reduce-scatters
        attributes = xr.global_runtime_device_attributes()
    except Exception:  # no runtime, or a torch_xla without these: reduce-scatter flat
        return None
    return from_coordinates([a.get("coords", ()) for a in attributes])


def stages(group: Sequence[int], shape: Optional[Tuple[int, ...]], mode: str = "auto") -> List[Stage]:
    """The reduce-scatter stages for one shard group holding every device, or [] for one flat
    reduce-scatter. Each stage lists its replica groups (device ids in rank order)."""
    if mode not in REDUCE_SCATTER_STAGES:
        raise ValueError(f"reduce_scatter_stages={mode!r}: use one of {REDUCE_SCATTER_STAGES}")
    if mode not in ("auto", "axes") or shape is None or sum(size > 1 for size in shape) < 2:
        return []
    n = math.prod(shape)
    if list(group) != list(range(n)):
        return []
    out: List[Stage] = []
    for axis in reversed(range(len(shape))):  # the slowest-varying axis first
        size, step = shape[axis], math.prod(shape[:axis])  # device id = x + X*(y + Y*z)
        if size > 1:
            groups = [[base + k * step for k in range(size)]
                      for base in range(n) if (base // step) % size == 0]
            out.append((groups, size))
    return out
