"""Our single-controller step compiled by libtpu 0.0.21 for a large v4 slice (v4-128: 64 chips
on a 4x4x4 torus), where the compiler rewrites collectives that it keeps on v4-8.

Two things found at the blog's 20B on v4-128 and checked here on a 2-layer GPT-2 of width 512
(tests/fixtures/gpt2-512.json; the tiny model's buffers all live in on-chip memory, where the
first one does not show), traced at 64 devices and compiled with the flags xla_fsdp sets on a
TPU; nothing mocked:
- libtpu compiles our reduce-scatters there as all-reduces of the whole bucket plus a slice.
  Unless the engine materializes the slice ([Note: materialize the scattered shard]), the
  slice is fused into the gradient norm, clipping and optimizer fusions at the end of the
  step, so every bucket's full-size result stays live through the rest of the backward (20B:
  43 GiB needed, does not fit; with the barrier: 14.6 GiB).
- without `xla_tpu_prefer_async_allgather_to_allreduce` every all-gather becomes a
  synchronous zero-padded all-reduce (twice the bytes).
- where rings do not apply the engine reduce-scatters one torus axis at a time there
  ("axes", what "auto" falls back to: [Note: one reduce-scatter per torus axis]), and those
  stay reduce-scatters: the gradient reduction
  sends the ring's (N-1)/N, not an all-reduce's twice that. The first check above traces
  with `reduce_scatter_stages="flat"`, where the all-reduces it guards still exist.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402

from common.hlo_graph import COLLECTIVES, HloGraph  # noqa: E402

from xla_fsdp.tpu import libtpu_flags as lf  # noqa: E402
from xla_fsdp.tpu import optimized_hlo as oh  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="the TPU compiler comes with `pip install -e .[tpu-aot]`")

TPU = "v4-128"
MODEL = os.path.join(os.path.dirname(__file__), "fixtures", "gpt2-512.json")


def _trace(tmp, stages: str, **settings) -> str:
    """The single-controller step traced at v4-128's 64 devices (the check's --dump); `stages`
    "auto": the engine's own choice there ([Note: reduce-scatter rings on pods]). The check compiles it
    with lf.ASYNC_COLLECTIVES, and that compile is what `_compile` gives for those flags."""
    case = ac.BY_NAME["sc-full_shard"]
    if stages != "auto":  # all-gathers and these stages
        case = dataclasses.replace(case, settings={**case.settings, "reduce_scatter_stages": stages,
                                                   "all_gather_impl": "all_gather", **settings})
    cmd = ac.command(case, 64, str(tmp / "fsdp.json"), str(tmp / "out"), model=MODEL, batch=1, block=128)
    return COMPILES.trace(cmd, str(tmp / "dump"), lf.ASYNC_COLLECTIVES, runtime=case.runtime)


@pytest.fixture(scope="module")
def traced_step(tmp_path_factory):
    """Reduce-scatters flat, as libtpu rewrites them into all-reduces here."""
    return _trace(tmp_path_factory.mktemp("v4_128_flat"), "flat")


@pytest.fixture(scope="module")
def traced_default(tmp_path_factory):
    return _trace(tmp_path_factory.mktemp("v4_128"), "axes")


@pytest.fixture(scope="module")
def traced_off_chain(tmp_path_factory):
    return _trace(tmp_path_factory.mktemp("v4_128_off"), "axes", token_chain="off")


@pytest.fixture(scope="module")
def traced_auto(tmp_path_factory):
    return _trace(tmp_path_factory.mktemp("v4_128_auto"), "auto")


COMPILES = ac.Compiles(TPU)  # each program compiled once per flag set, the checks' own compiles included
_compile = COMPILES.compile


@pytest.fixture(scope="module")
def compiled(traced_step):
    return _compile(traced_step, lf.ASYNC_COLLECTIVES)


def test_reduced_gradients_do_not_hold_full_size_buffers_to_the_end_of_the_step(compiled):
    held = oh.scatters_as_all_reduce(compiled["optimized_hlo"])
    assert held, "no reduce-scatter compiled as an all-reduce: the check lost what it guards"
    worst = max(held, key=lambda h: h.held_for)
    # with the barrier: 2 instructions; without it, over 200 (the slice waits for the clipping)
    assert worst.held_for <= 32, (
        f"{worst.name} ({worst.bytes} bytes, a reduce-scatter compiled as an all-reduce) stays live for "
        f"{worst.held_for} instructions: its slice was fused into a later consumer")


def test_all_gathers_stay_asynchronous_gathers_on_a_three_axis_torus(traced_step, compiled):
    gathers = compiled["collectives"]["by_kind"].get("all-gather", {})
    assert gathers.get("async", 0) > 0 and gathers.get("async_with_matmul", 0) > 0, compiled["collectives"]
    flag = "xla_tpu_prefer_async_allgather_to_allreduce"
    without = _compile(traced_step, {k: v for k, v in lf.ASYNC_COLLECTIVES.items() if k != flag})
    assert "all-gather" not in without["collectives"]["by_kind"], (
        f"without --{flag} the gathers stayed gathers on {TPU}: the flag no longer does anything here",
        without["collectives"]["by_kind"])


def test_gradients_reduce_scatter_along_each_torus_axis_and_stay_reduce_scatters(compiled, traced_default):
    default = _compile(traced_default, lf.ASYNC_COLLECTIVES)["collectives"]["by_kind"]
    flat = compiled["collectives"]["by_kind"]
    # flat: libtpu turned the 64-chip reduce-scatters into all-reduces (the check above guards them)
    assert flat.get("all-reduce", {}).get("sent", 0) > flat.get("reduce-scatter", {}).get("sent", 0), flat
    # in stages they stay reduce-scatters; what all-reduces remain (loss, norms, the few buckets of
    # under 8 rows per shard) send under 5% of the reduce-scatters' bytes
    scattered = default.get("reduce-scatter", {}).get("sent", 0)
    assert scattered > 0 and default.get("all-reduce", {}).get("sent", 0) < 0.05 * scattered, default
    # and the gradient reduction sends about half what the flat program's all-reduces did
    assert scattered < 0.6 * flat["all-reduce"]["sent"], (default, flat)


@pytest.mark.slow  # the default's rings beside compute on v4-8: test_tpu_compile_matrix.py
def test_the_default_on_a_pod_rings_the_reduce_scatters_beside_compute(traced_default, traced_auto):
    """[Note: reduce-scatter rings on pods]: "auto" on v4-128 leaves no reduce-scatter in the
    TPU program; the gradients travel as collective-permutes, asynchronous, sending about what
    the staged reduce-scatters sent, while the parameters keep their all-gathers."""
    staged = _compile(traced_default, lf.ASYNC_COLLECTIVES)["collectives"]
    auto = _compile(traced_auto, lf.ASYNC_COLLECTIVES)["collectives"]
    kinds = auto["by_kind"]
    assert "reduce-scatter" not in kinds and kinds.get("all-gather", {}).get("async", 0) > 0, kinds
    permutes = kinds["collective-permute"]
    assert permutes["sync"] == 0 and permutes["async_bytes_fraction"] == 1.0, permutes
    scattered = staged["by_kind"]["reduce-scatter"]["sent"]
    assert 0.9 * scattered < permutes["sent"] < 1.2 * scattered, (permutes, staged["by_kind"])
    assert auto["async_bytes_fraction"] > staged["async_bytes_fraction"] + 0.2, (auto, staged)


def test_staged_reduce_scatters_run_beside_compute_with_the_large_pods_flags(traced_default):
    """[Note: asynchronous staged reduce-scatters]: with libtpu's async reduce-scatter fusion
    some of the staged reduce-scatters become asynchronous and the step projects shorter; the
    flags xla_fsdp sets for a single controller on slices of more than 64 chips."""
    plain = _compile(traced_default, lf.ASYNC_COLLECTIVES)
    pods = _compile(traced_default, {**lf.ASYNC_COLLECTIVES, **lf.ASYNC_REDUCE_SCATTERS})
    before, after = (r["collectives"]["by_kind"]["reduce-scatter"] for r in (plain, pods))
    assert before["async"] == 0 and after["async"] >= 1 and after["async_with_matmul"] >= 1, (before, after)
    assert pods["projection"]["projected_seconds"] < plain["projection"]["projected_seconds"]


def _source(g: HloGraph, name: str):
    """What `name` holds, looking through reshapes, conversions and tuple reads."""
    while g.instrs[name].opcode in ("reshape", "bitcast", "convert", "get-tuple-element"):
        name = g.instrs[name].operands[0]
    return g.instrs[name]


def _scatter_inputs(text: str):
    """(first stages, later stages) of the staged reduce-scatters: what each one's data comes from."""
    g = HloGraph(text)
    first, later = [], []
    for c in g.collectives(("reduce-scatter",)):
        add = g.instrs[c.operands[0]]
        if add.opcode != "add" or len(c.shape) != 2:
            continue  # flat buckets; off the chain the zero token's add is folded away
        data = [o for o in add.operands if g.instrs[o].opcode != "broadcast"]  # the token is broadcast
        token = [o for o in add.operands if g.instrs[o].opcode == "broadcast"]
        if len(data) != 1 or not any(g.instrs[a].opcode in COLLECTIVES for t in token for a in g.ancestors(t)):
            continue  # a fresh token, a constant zero ([Note: the last reduce-scatter]): nothing to wait for
        data = _source(g, data[0])
        (later if data.opcode == "reduce-scatter" else first).append((c.name, data.opcode))
    return first, later


@pytest.mark.slow  # token_chain="off" trains like the unsharded run by default: test_run_clm_llama.py
def test_staged_gradients_meet_the_token_after_a_barrier(traced_default, traced_off_chain):
    """[Note: the gradient apart from the chain]: each gradient whose reduce-scatter runs in torus
    stages reaches the token's add through an optimization barrier, so libtpu cannot fuse the add
    into the matmul that makes the gradient (that matmul would wait for the previous reduce-scatter);
    the later stages take the earlier stage's result, and the chain's order stays (every stage reads
    the token of the reduce-scatter before it)."""
    first, later = _scatter_inputs(traced_default)
    assert first and later, (first, later)  # staged: first stages and the stages after them
    assert all(opcode == "opt-barrier" for _, opcode in first), [f for f in first if f[1] != "opt-barrier"]
    # off the chain (token_chain="off", the Llama config) nothing waits for a token, and no
    # gradient pays the barrier's pass: every staged reduce-scatter takes it as it is
    g = HloGraph(traced_off_chain)
    scatters = [c for c in g.collectives(("reduce-scatter",)) if len(c.shape) == 2]
    assert scatters, "no staged reduce-scatter traced off the chain"
    assert not any(g.instrs[a].opcode == "opt-barrier" for c in scatters for a in _near(g, c.operands[0])), scatters


def _near(g: HloGraph, name: str):
    """`name` and what it comes from through reshapes, conversions, tuple reads and the token's add."""
    out = [name]
    while g.instrs[name].opcode in ("reshape", "bitcast", "convert", "get-tuple-element", "add"):
        ops = [o for o in g.instrs[name].operands if g.instrs[o].opcode != "broadcast"]
        if len(ops) != 1:
            break
        name = ops[0]
        out.append(name)
    return out
