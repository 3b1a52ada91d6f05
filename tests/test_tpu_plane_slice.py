"""Our single-controller step compiled by libtpu 0.0.21 for a large 2-D slice (v6e-256: 256
chips, 16 x 16), where the compiler rewrites the flat reduce-scatters it keeps on v6e-8.

[Note: staged on 2-D slices] in xla_fsdp/collective_engine/torus.py: reduce-scatters over all
256 chips become synchronous all-reduces of the whole bucket (twice the bytes); staged along the
two torus axes, which the engine's default does there, they stay reduce-scatters. Checked on a
2-layer GPT-2 of width 512 (tests/fixtures/gpt2-512.json) traced at 256 devices by the check
(which sets the slice's shape, 16x16) and compiled with the flags xla_fsdp sets; nothing mocked.
Runs under `pytest -m slow` (two 256-device traces and compiles, about 50 s here).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402

from xla_fsdp.tpu import libtpu_flags as lf  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="the TPU compiler comes with `pip install -e .[tpu-aot]`")

TPU = "v6e-256"
MODEL = os.path.join(os.path.dirname(__file__), "fixtures", "gpt2-512.json")


def _collectives(tmp, stages: str) -> dict:
    """The step's collectives by kind, compiled for v6e-256; `stages` "auto": the engine's own
    choice there."""
    tmp.mkdir()
    case = ac.BY_NAME["sc-full_shard"]
    if stages != "auto":
        case = dataclasses.replace(case, settings={**case.settings, "reduce_scatter_stages": stages})
    cmd = ac.command(case, 256, str(tmp / "fsdp.json"), str(tmp / "out"), model=MODEL, batch=1, block=128)
    got = ac.check(TPU, cmd, runtime=case.runtime,
                   extra=["--libtpu-flags", lf.init_args(lf.ASYNC_COLLECTIVES)])
    assert got["report"] and got["report"]["compiles"], got["output"]
    return got["report"]["collectives"]["by_kind"]


# -m slow: the same libtpu property (flat reduce-scatters become all-reduces at scale, staged ones stay
# reduce-scatters) is compiled in the default run on v4-128's three axes,
# tests/test_tpu_large_slice.py::test_gradients_reduce_scatter_along_each_torus_axis_and_stay_reduce_scatters,
# and the engine's choice of the two axes here by tests/test_torus.py (a plane slice)
@pytest.mark.slow
def test_a_plane_pods_gradients_reduce_scatter_along_its_two_axes_and_stay_reduce_scatters(tmp_path):
    flat = _collectives(tmp_path / "flat", "flat")
    default = _collectives(tmp_path / "auto", "auto")
    # flat: libtpu turned the 256-chip reduce-scatters into all-reduces
    assert flat.get("all-reduce", {}).get("sent", 0) > 10 * flat.get("reduce-scatter", {}).get("sent", 0), flat
    # the default stages them, and they stay reduce-scatters; what all-reduces remain (loss, norms,
    # buckets of under 8 rows per shard, many at 256 chips and width 512) send under 10% of the
    # reduce-scatters' bytes
    scattered = default.get("reduce-scatter", {}).get("sent", 0)
    assert scattered > 0 and default.get("all-reduce", {}).get("sent", 0) < 0.1 * scattered, default
    # (no reduce-scatter rings: those would leave no reduce-scatter at all)
    assert scattered < 0.6 * flat["all-reduce"]["sent"], (default, flat)
