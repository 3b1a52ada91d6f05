"""Every training program we ship compiles for Cloud TPU: libtpu's own compiler, on this host.

Each case is traced at the slice's device count by `python -m xla_fsdp.aot`
(nothing executes) and compiled for v4-8 or v5e-8 with libtpu 0.0.21. A
compile error fails the test with the compiler's own text. The default run
keeps one representative of each runtime, engine and feature family; the
full matrix (every case on both slices, and the Hugging Face Trainer step)
runs under `pytest -m slow`.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402
from xla_fsdp.tpu import optimized_hlo as oh  # noqa: E402

pytest.importorskip("libtpu", reason="the TPU compiler comes with `pip install -e .[tpu-aot]` (make test installs it)")

CHIPS = {"v4-8": 4, "v5e-8": 8}
# one process per chip (mp-full_shard on v4-8) is compiled by tests/test_aot.py's report test; the
# single controller on v4-8 by tests/test_libtpu_flags.py (and the make-train test under -m slow), on
# v5e-8 (with per-layer checkpointing: the shipped config) by the default-configuration test, with a replica axis
# (sc-hybrid: gathers and reduce-scatters, no rings) on v5e-16 by tests/test_aot.py's multi-host
# test; every case on both slices, one process per chip with checkpointing among them, under -m slow
DEFAULT = [
    ("gspmd", "v5e-8"),               # the GSPMD engine
]
FULL = [(c.name, tpu) for c in ac.MATRIX for tpu in CHIPS]


def _assert_compiles(got: dict, what: str) -> dict:
    report = got["report"]
    assert report is not None, f"{what}: no report (exit {got['rc']}):\n{got['output']}"
    assert report["compiles"], f"{what} does not compile for {report['tpu']}:\n{report['error'][:3000]}\n" \
                               f"cause: {report['cause']}"
    assert report["fits"] and got["rc"] == 0, (what, got["rc"], report["memory"])
    assert report["memory"]["peak"] > 0 and report["collectives"]["count"] > 0, report
    return report


def _check_case(name: str, tpu: str, tmp_path) -> dict:
    case = ac.BY_NAME[name]
    cmd = ac.command(case, CHIPS[tpu], str(tmp_path / "fsdp.json"), str(tmp_path / "out"))
    return _assert_compiles(ac.check(tpu, cmd, runtime=case.runtime), f"{name} on {tpu}")


@pytest.mark.parametrize("name,tpu", DEFAULT, ids=[f"{n}-{t}" for n, t in DEFAULT])
def test_representative_programs_compile_for_tpu(name, tpu, tmp_path):
    report = _check_case(name, tpu, tmp_path)
    assert report["chips"] == CHIPS[tpu]
    expected = "per_replica" if ac.BY_NAME[name].runtime == ac.MULTI else "spmd"
    assert report["program"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("name,tpu", FULL, ids=[f"{n}-{t}" for n, t in FULL])
def test_every_program_compiles_for_tpu(name, tpu, tmp_path):
    _check_case(name, tpu, tmp_path)


def _run_clm_on_tpu(config: str, tmp_path) -> list:
    """run_clm as the README launches it on a TPU (xla_spawn, no runtime flag: the single
    controller it declares), tiny GPT-2, with the fsdp_config at `config`."""
    return [os.path.join(ac.ROOT, "launch", "xla_spawn.py"), ac.RUN_CLM, "--config_name", ac.TINY,
            "--fsdp", "full_shard", "--fsdp_config", config, "--output_dir", str(tmp_path / "out"),
            "--do_train", "--per_device_train_batch_size", "2", "--block_size", "64"]


def _config_with(tmp_path, **settings) -> str:
    with open(SHIPPED) as f:
        config = json.load(f)
    config["xla_fsdp_settings"].update(settings)
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(config))
    return str(path)


SHIPPED = os.path.join(ac.ROOT, "configs", "fsdp", "gpt2_xla_fsdp.json")


def test_default_configuration_runs_its_collectives_asynchronously_beside_compute(tmp_path):
    """The shipped configs/fsdp/gpt2_xla_fsdp.json under the libtpu flags xla_fsdp sets for the
    single controller, tiny GPT-2 on v5e-8: "auto" makes the gathers and the gradient
    reduce-scatters rings of collective-permutes ([Note: rings by default on a TPU]), every one
    asynchronous with compute between start and done. Fails if a change makes them
    synchronous again (pinned collectives, a runtime change, "auto" no longer choosing rings, a
    flag dropped) or brings back a gather or reduce-scatter."""
    report = _assert_compiles(ac.check("v5e-8", _run_clm_on_tpu(SHIPPED, tmp_path), runtime="auto"),
                              "the default configuration")
    assert report["runtime"] == ac.SINGLE and report["program"] == "spmd", report["runtime"]
    assert "xla_tpu_scheduler_percent_shared_memory_limit=50" in report["libtpu_flags"], report["libtpu_flags"]
    c = report["collectives"]
    assert "all-gather" not in c["by_kind"] and "reduce-scatter" not in c["by_kind"], c
    permutes = c["by_kind"]["collective-permute"]
    # libtpu 0.0.21: 196 asynchronous, 13 with a matmul inside, none synchronous
    assert permutes["async"] >= 100 and not permutes.get("sync") and permutes["async_with_matmul"] >= 4, c
    assert c["sent_async_with_compute_fraction"] >= 0.95, c  # 1.00
    p = report["projection"]
    assert p["label"] == "projection" and 0 < p["async_collective_seconds"]
    assert p["projected_seconds"] < p["compute_seconds"] + p["sync_collective_seconds"] + p["async_collective_seconds"]


# -m slow: gathers asynchronous beside matmuls under xla_fsdp's flags are compiled in the default run by
# tests/test_libtpu_flags.py::test_the_flags_make_v4_run_our_gathers_asynchronously_beside_matmuls (v4-8,
# all_gather_impl="all_gather"), staged 2-D reduce-scatters kept as reduce-scatters by tests/test_tpu_large_slice.py
@pytest.mark.slow
def test_gathers_run_asynchronously_beside_compute(tmp_path):
    """The collectives where rings do not apply (all_gather_impl="all_gather"; also sharding
    groups and HYBRID_SHARD), tiny GPT-2 on v5e-8: the all-gathers asynchronous with matmuls
    beside them, the large buckets' gradients reduce-scatters ([Note: 2-D reduce-scatter]), not
    all-reduces. Fails if a change makes the gathers synchronous again."""
    cmd = _run_clm_on_tpu(_config_with(tmp_path, all_gather_impl="all_gather"), tmp_path)
    report = _assert_compiles(ac.check("v5e-8", cmd, runtime="auto"), "all_gather_impl='all_gather'")
    c = report["collectives"]
    assert "collective-permute" not in c["by_kind"], c
    gathers = c["by_kind"]["all-gather"]
    assert gathers["async"] >= 4 and gathers["async_with_matmul"] == gathers["async"], c  # 6 and 6
    assert c["sent_async_with_matmul_fraction"] >= 0.2, c  # 0.27 with libtpu 0.0.21
    assert c["by_kind"].get("reduce-scatter", {}).get("sync", 0) >= 5, c  # 7


@pytest.mark.slow  # the default run compiles the same rings on v5e-8 in the default-configuration test above
def test_rings_run_asynchronously_beside_compute(tmp_path):
    """reduce_scatter_stages="ring" and all_gather_impl="ring" ([Note: ring reduce-scatter]), what
    "auto" chooses on a TPU, named explicitly, tiny GPT-2 on v4-8 (2x2: a ring per torus axis): gradients and parameters travel as collective-permutes that libtpu runs
    asynchronously with matmuls beside them, and no reduce-scatter or all-gather is left. Fails
    if the rings come out as gathers or all-to-alls, or synchronous."""
    cmd = _run_clm_on_tpu(_config_with(tmp_path, reduce_scatter_stages="ring", all_gather_impl="ring"), tmp_path)
    report = _assert_compiles(ac.check("v4-8", cmd, runtime="auto"), "the rings")
    c = report["collectives"]
    assert "reduce-scatter" not in c["by_kind"] and "all-gather" not in c["by_kind"], c
    permutes = c["by_kind"]["collective-permute"]
    # libtpu 0.0.21: 56 asynchronous, 11 with a matmul inside (a tiny model has little to overlap)
    assert permutes["async"] >= 8 and permutes["async_with_matmul"] >= 4, c
    assert not permutes.get("sync"), c


@pytest.mark.slow  # the same rings, asynchronous beside matmuls: the default-configuration test above (v5e-8)
def test_make_train_job_compiles_for_tpu(tmp_path):
    """`make train`'s command, as it runs here (the single controller over 4 devices), for v4-8:
    "auto" makes rings there too (fp32, 2x2 chips: a ring per torus axis), and libtpu runs them
    asynchronously with matmuls beside them; no reduce-scatter or all-gather is left."""
    cmd = [os.path.join(ac.ROOT, "launch", "xla_spawn.py"), "--num_cores", "4", ac.RUN_CLM,
           "--config_name", ac.TINY, "--fsdp", "full_shard",
           "--fsdp_config", os.path.join(ac.ROOT, "configs", "fsdp", "tiny_cpu.json"),
           "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir"]
    report = _assert_compiles(ac.check("v4-8", cmd, runtime="single_controller"), "make train's job")
    assert report["program"] == "spmd"
    c = report["collectives"]
    assert "reduce-scatter" not in c["by_kind"] and "all-gather" not in c["by_kind"], c
    permutes = c["by_kind"]["collective-permute"]
    assert permutes["async"] >= 8 and permutes["async_with_matmul"] >= 4 and not permutes.get("sync"), c


@pytest.mark.slow
def test_hugging_face_trainer_step_compiles_for_tpu(tmp_path):
    """The Trainer integration's step (fsdp_config xla: true), one process per chip."""
    script = os.path.join(ac.ROOT, "tests", "fixtures", "hf_trainer_job.py")
    config = os.path.join(ac.ROOT, "configs", "fsdp", "gpt2_xla_fsdp.json")
    # the Trainer reads the loss back after every step: check its first step's program
    got = ac.check("v4-8", [script, str(tmp_path), config, "3"], runtime="multi_process", extra=["--steps", "1"])
    _assert_compiles(got, "the HF Trainer step")


def test_the_shipped_scan_config_compiles_its_loops_reading_in_place_into_unwritten_buffers(tmp_path):
    """configs/fsdp/gpt2_xla_fsdp_scan.json (the collectives engine's scanned layers, stored stacks)
    on the tiny GPT-2 for v4-8: it compiles and fits; each loop reads the next (previous) layer's
    shards in place, not from a rolled copy of the stacks, and its output buffers are libtpu's
    unwritten AllocateBuffer in the program libtpu optimized ([Note: the loop's output buffers]).
    In that program the loop bodies hold no emulated 64-bit index arithmetic ([Note: the loop's
    32-bit indices]) and compute each trip's slice of a stack once ([Note: a trip's slice, held])."""
    config = os.path.join(ac.ROOT, "configs", "fsdp", "gpt2_xla_fsdp_scan.json")
    cmd = [ac.RUN_CLM, "--config_name", ac.TINY, "--fsdp", "full_shard", "--fsdp_config", config,
           "--output_dir", str(tmp_path / "out"), "--do_train", "--per_device_train_batch_size", "2",
           "--block_size", "64"]
    got = ac.check("v4-8", cmd, extra=["--dump", str(tmp_path / "dump")], timeout=600)
    _assert_compiles(got, "the scanned tiny GPT-2")
    traced = (tmp_path / "dump" / "traced_step.hlo.txt").read_text()
    optimized = (tmp_path / "dump" / "tpu_optimized.hlo.txt").read_text()
    assert "xla__scan_in_region" in traced and "aten__roll" not in traced
    buffers = [line for line in optimized.splitlines()
               if 'custom_call_target="AllocateBuffer"' in line and "region_loop.py" in line]
    assert len(buffers) >= 2, "the loops' output buffers were not left unwritten"
    comps = oh.computations(optimized)
    for loop in oh.while_loops(optimized):
        name, body = loop["body"], comps[loop["body"]]
        wide = [x for x in body if re.match(r"(s64|u64|u32)\[\]", x.shape)
                and x.opcode not in ("parameter", "get-tuple-element", "constant")]
        assert not wide, f"loop body {name}: 64-bit index arithmetic emulated on the TPU's 32-bit scalar unit " \
                         f"({len(wide)} ops, e.g. {wide[0]})"
        slices = [k for k in (_sliced_stack(x, comps) for x in body) if k is not None]
        assert slices, f"loop body {name}: no slice of a stack found (the check no longer sees them)"
        twice = sorted({k for k in slices if slices.count(k) > 1})
        assert not twice, f"loop body {name}: a trip's slice of a stack is computed more than once: {twice}"


def _sliced_stack(ins, comps):
    """(stack, index) for a fusion that only takes a dynamic slice of its first operand; else None."""
    callee = re.search(r"calls=%?([\w.\-]+)", ins.rest)
    operands = oh.operand_names(ins.rest)
    if ins.opcode != "fusion" or not callee or len(operands) != 2:
        return None
    ops = {x.opcode for x in comps.get(callee.group(1), [])}
    if "dynamic-slice" not in ops or ops - {"parameter", "constant", "dynamic-slice", "bitcast"}:
        return None
    return tuple(operands)
