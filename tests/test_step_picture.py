"""The check's picture of the step and its memory breakdown (issue 83 items 3 and 4).

libtpu 0.0.21 compiles here without a TPU; nothing is mocked. A hand-written module checks the
buffer assignment reader against the bytes the module declares; a tiny GPT-2 job checks the page
(`--timeline`) and the breakdown end to end: every collective of the report is one span of the SVG
(read back with an XML parser), the page loads nothing from outside, the parts sum to libtpu's
peak, and the arguments split as the job holds them (AdamW: two moments per parameter).
The 125M GPT-2 on v4-8 and the 16B v4-64 pair run under `-m slow`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
import xml.etree.ElementTree as ET

import pytest

if importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jaxlib") is None:
    pytest.skip("libtpu's TPU compiler and jaxlib are not installed: `pip install -e .[tpu-aot]`",
                allow_module_level=True)

from common import aot_cases as ac  # noqa: E402
from test_tpu_compiler import collectives_module  # noqa: E402

from xla_fsdp.aot import report as rep  # noqa: E402
from xla_fsdp.tpu import buffer_assignment, memory_breakdown, pjrt, topology  # noqa: E402
from xla_fsdp.tpu import compile_options as co  # noqa: E402

ROOT = ac.ROOT
F32 = 4
SVG = "{http://www.w3.org/2000/svg}"


def test_the_buffer_assignment_holds_the_modules_arguments_at_their_declared_sizes():
    """[Note: libtpu's buffer assignment]: the module's two f32 parameters, [8,128] and [128,128],
    are the program's two argument allocations at their sizes (whole (8,128) tiles: no padding);
    the all-gather's result lives in the heap or the core's memory, and the schedule places every
    value the assignment names."""
    compiler = pjrt.get_compiler()
    spec = topology.parse_accelerator_type("v4-8")
    dumps = tempfile.mkdtemp()
    try:
        with compiler.topology(spec.topology_name, spec.options) as t:
            program = compiler.compile(t, co.hlo_text_to_proto(collectives_module(len(t.devices))),
                                       co.spmd_options(t.device_ids, [(rep.DUMP_FLAG, dumps)]))
        ba = buffer_assignment.read(dumps)
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    assert ba is not None
    assert buffer_assignment.parameter_sizes(ba) == {0: 8 * 128 * F32, 1: 128 * 128 * F32}
    assert sum(buffer_assignment.parameter_sizes(ba).values()) == program.memory.argument_size
    gathered = [v for v in ba.values.values() if v.instruction.startswith("ag")]
    assert gathered and all(v.size == 4 * 8 * 128 * F32 for v in gathered), gathered
    order = set(memory_breakdown.schedule(program.optimized_hlo))
    placed = [v for v in ba.values.values() if ba.allocations[v.allocation].kind != "thread-local"]
    assert all(v.instruction in order for v in placed), [v.instruction for v in placed if v.instruction not in order]


def _svg(page: str) -> ET.Element:
    body = page[page.index("<svg"):page.index("</svg>") + len("</svg>")]
    return ET.fromstring(body)


def check_page_and_breakdown(report: dict, page_path: str) -> dict:
    """What every picture must hold; the breakdown's parts."""
    with open(page_path) as f:
        page = f.read()
    # self-contained: no script, no link, no stylesheet or image from elsewhere
    for pattern in (r"<script", r"\bsrc=", r"\bhref=", r"url\(", r"@import"):
        assert not re.search(pattern, page), pattern
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"]  # the SVG namespace
    svg = _svg(page)
    spans = [g for g in svg.iter(SVG + "g") if g.get("class") == "collective"]
    assert len(spans) == report["collectives"]["count"] > 0, (len(spans), report["collectives"]["count"])
    kinds = {g.get("data-kind") for g in spans}
    assert [p for p in svg.iter(SVG + "path") if p.get("class") == "hbm"], "no HBM curve"
    assert [r for r in svg.iter(SVG + "rect") if r.get("class") == "compute"], "no compute lane"
    b = report["memory"]["breakdown"]
    assert set(b["parts"]) == set(memory_breakdown.PARTS) and min(b["parts"].values()) >= 0, b
    assert b["sum"] == sum(b["parts"].values())
    assert abs(b["sum"] - report["memory"]["peak"]) <= 0.01 * report["memory"]["peak"], b
    assert b["peak"] == report["memory"]["peak"]
    return {"parts": b["parts"], "kinds": kinds, "page": page}


def _check(tmp_path, tpu: str, cmd: list, extra=()) -> tuple:
    page = tmp_path / "step.html"
    got = ac.check(tpu, cmd, extra=["--timeline", str(page), *extra], timeout=3600)
    assert got["rc"] == 0 and got["report"], got["output"]
    return got["report"], str(page)


def test_the_tiny_jobs_page_has_every_collective_and_its_peak_broken_down(tmp_path):
    """run_clm's single controller on v4-8 (its default rings): each ring's permutes on the lane of
    the collective it performs ([Note: which ring a permute belongs to]); the arguments are the
    parameters and AdamW's two moments of each, and the parts sum to libtpu's peak."""
    cmd = [os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", "4", ac.RUN_CLM, "--config_name",
           os.path.join(ROOT, "configs", "models", "gpt2-tiny.json"), "--per_device_train_batch_size", "8",
           "--block_size", "128", "--fsdp", "full_shard", "--output_dir", str(tmp_path / "out"), "--do_train"]
    report, page = _check(tmp_path, "v4-8", cmd, ["--dump", str(tmp_path / "dump")])
    got = check_page_and_breakdown(report, page)
    assert {"reduce-scatter (ring)", "all-gather (ring)"} <= got["kinds"], got["kinds"]
    parts = got["parts"]
    assert report["memory"]["breakdown"]["arguments_by_kind"] is True
    # AdamW: exp_avg and exp_avg_sq per parameter (and a step count each, a few scalars)
    assert 2 * parts["parameters"] <= parts["optimizer state"] <= 2 * parts["parameters"] + 64 * 1024, parts
    args = parts["parameters"] + parts["optimizer state"] + parts["other inputs"]
    assert args == report["memory"]["arguments"], (args, report["memory"]["arguments"])
    # the kernels table names the layer whose code issued each: GPT-2's projections are Conv1D layers
    assert "pytorch_utils.py:" in got["page"] and "(Conv1D.forward)" in got["page"], "kernels not named"
    # --dump keeps libtpu's buffer assignment beside the programs
    assert (tmp_path / "dump" / rep.BUFFER_ASSIGNMENT).stat().st_size > 0


@pytest.mark.slow
def test_gpt2_125m_on_v4_8(tmp_path):
    cmd = [os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", "4", ac.RUN_CLM, "--config_name",
           os.path.join(ROOT, "configs", "models", "gpt2-125m.json"), "--per_device_train_batch_size", "8",
           "--block_size", "1024", "--fsdp", "full_shard", "--output_dir", str(tmp_path / "out"), "--do_train"]
    report, page = _check(tmp_path, "v4-8", cmd)
    got = check_page_and_breakdown(report, page)
    assert got["parts"]["activations"] > 0 and got["parts"]["parameters"] > 0, got["parts"]
    print(json.dumps(report["memory"]["breakdown"]))


@pytest.mark.slow
def test_the_scanned_2b_on_v4_8(tmp_path):
    """docs/scan.md's 2B GPT-2 on v4-8 with scan_layers (two While loops of 18 trips) and the kernel:
    the loops' collectives drawn once per trip; the forward loop's saved stacks are activations."""
    cmd = [ac.RUN_CLM, "--config_name", os.path.join(ROOT, "configs", "models", "gpt2-2b-nodropout.json"),
           "--per_device_train_batch_size", "32", "--block_size", "1024", "--fsdp", "full_shard",
           "--fsdp_config", os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp_scan.json"),
           "--attn_implementation", "pallas", "--output_dir", str(tmp_path / "out")]
    report, page = _check(tmp_path, "v4-8", cmd)
    assert [loop["trip_count"] for loop in report["while_loops"]] == [18, 18], report["while_loops"]
    got = check_page_and_breakdown(report, page)
    assert "loop trip 17" in got["page"], "the loops' last trip is not drawn"
    parts = got["parts"]
    assert parts["activations"] > parts["temporaries"], parts
    assert 2 * parts["parameters"] <= parts["optimizer state"] <= 2 * parts["parameters"] + 2 ** 20, parts  # AdamW
    print(json.dumps(report["memory"]["breakdown"]))


@pytest.mark.slow
def test_the_16b_v4_64_pair(tmp_path):
    """The blog's 16B GPT-2 on v4-64, 16 x 1024 per chip: the shipped config with the Pallas kernel and
    the last 3 blocks keeping their activations, what its "fit" chooses there (bench/blog_pairs.py
    --pairs 16b --engines keep3 --attn pallas; docs/performance.md's row). With transformers' default
    attention the step does not fit on v4-64 (34.25 GB needed of 33.02, measured 2026-12-07)."""
    from common import perf_rows

    cmd, _ = perf_rows.command("keep3", "16b-nodropout", "v4-64", str(tmp_path), batch=16, attn="pallas")
    report, page = _check(tmp_path, "v4-64", cmd)
    got = check_page_and_breakdown(report, page)
    assert got["parts"]["parameters"] > 0 and got["parts"]["optimizer state"] > 0, got["parts"]
    print(json.dumps(report["memory"]["breakdown"]))
