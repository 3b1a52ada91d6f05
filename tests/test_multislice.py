"""A job that spans slices shards within a slice and replicates across slices (issue 82 items 1
and 5; [Note: HSDP across slices] in xla_fsdp/runtime/slices.py), proved on XLA:CPU, where
`MEGASCALE_NUM_SLICES=2` splits 8 devices into 2 virtual slices of 4.

run_clm's tiny job, launched as the README says (`xla_spawn --num_cores 8`), on both engines:
- a checkpoint of 2 slices resumes at 1, and one of 1 slice at 2, with the uninterrupted losses;
- the same 6 steps' losses, within 1e-5 relative, as one device with the same global batch and
  as 8 devices in one slice;
- XLA:CPU's optimized step (XLA's own dump) gathers and reduce-scatters within the slices only
  ({{0,1,2,3},{4,5,6,7}}), and the collective engine all-reduces each scattered gradient shard
  across the slices ({{0,4},{1,5},{2,6},{3,7}}), once; on one slice the gathers span all 8.
FSDP2's door (a 1-D mesh on 2 slices) is tests/test_fsdp2.py's `slices2` variant, against
PyTorch's own FSDP2.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLICE_GROUPS = "{{0,1,2,3},{4,5,6,7}}"
ACROSS = "{{0,4},{1,5},{2,6},{3,7}}"
ALL = "{{0,1,2,3,4,5,6,7}}"
RUNS = {  # name: (devices, slices, fsdp_config)
    "one_device": (1, 1, "tiny_cpu.json"),
    "one_slice": (8, 1, "tiny_cpu.json"),
    "collectives_2_slices": (8, 2, "tiny_cpu.json"),
    "gspmd_2_slices": (8, 2, "tiny_cpu_v2.json"),
    "rings_2_slices": (8, 2, "rings"),  # RINGS: gathers and reduce-scatters as rings within each slice
    "staged_2_slices": (8, 2, "tiny_cpu.json"),  # each slice a 2x2x1 torus: reduce-scatters staged per axis
}
STAGED_TORUS = "2x2x1"  # one slice's 4 devices ([Note: one reduce-scatter per torus axis], torus.each_slice)
RINGS = {"fsdp_transformer_layer_cls_to_wrap": ["GPT2Block"], "xla": True,
         "xla_fsdp_settings": {"compute_dtype": "float32", "all_gather_impl": "ring", "reduce_scatter_stages": "ring"}}
# checkpoint-3 of one run, resumed at another number of slices: (devices, slices, fsdp_config, from)
RESUMED = {
    "resumed_2_to_1": (8, 1, "tiny_cpu.json", "collectives_2_slices"),
    "resumed_1_to_2": (8, 2, "tiny_cpu.json", "one_slice"),
    "gspmd_resumed_2_to_1": (8, 1, "tiny_cpu_v2.json", "gspmd_2_slices"),
}
SAVES = ("one_slice", "collectives_2_slices", "gspmd_2_slices")  # save at step 3
GLOBAL_BATCH = 16


def _start(tmp: Path, name: str) -> subprocess.Popen:
    devices, slices, config, *source = RUNS.get(name) or RESUMED[name]
    if config == "rings":
        (tmp / "rings.json").write_text(json.dumps(RINGS))
    config_path = tmp / "rings.json" if config == "rings" else ROOT / "configs" / "fsdp" / config
    env = dict(os.environ, PJRT_DEVICE="CPU", MEGASCALE_NUM_SLICES=str(slices))
    for var in ("CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FSDP_TORUS"):
        env.pop(var, None)
    if name == "staged_2_slices":
        env["XLA_FSDP_TORUS"] = STAGED_TORUS
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={tmp / name / 'hlo'} --xla_dump_hlo_as_text"
    cmd = [sys.executable, str(ROOT / "launch" / "xla_spawn.py"), "--num_cores", str(devices),
           str(ROOT / "launch" / "run_clm.py"), "--output_dir", str(tmp / name / "out"),
           "--config_name", str(ROOT / "configs" / "models" / "gpt2-tiny.json"), "--fsdp", "full_shard auto_wrap",
           "--fsdp_config", str(config_path), "--do_train", "--max_steps", "6",
           "--per_device_train_batch_size", str(GLOBAL_BATCH // devices), "--block_size", "32",
           "--logging_steps", "1", "--learning_rate", "3e-3", "--seed", "3"]
    if name in SAVES:
        cmd += ["--save_strategy", "steps", "--save_steps", "3"]
    if source:
        cmd += ["--resume_from_checkpoint", str(tmp / source[0] / "out" / "checkpoint-3")]
    (tmp / name).mkdir(parents=True)
    log = open(tmp / name / "log.txt", "w")
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multislice")
    procs = {}
    try:
        for name in [*RUNS, *RESUMED]:  # two at a time: this machine has two cores; the resumed ones last
            procs[name] = _start(tmp, name)
            if len(procs) % 2 == 0:
                for p in procs.values():
                    p.wait(timeout=600)
        out = {}
        for name, proc in procs.items():
            rc = proc.wait(timeout=600)
            log = (tmp / name / "log.txt").read_text()
            assert rc == 0, f"{name} exited {rc}:\n{log[-3000:]}"
            out[name] = (json.loads((tmp / name / "out" / "metrics.json").read_text()), tmp / name / "hlo")
        return out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def _step_program(hlo: Path) -> str:
    """The training step as XLA:CPU optimized it: the largest dumped program that gathers."""
    texts = [Path(f).read_text() for f in glob.glob(str(hlo / "*after_optimizations.txt"))]
    steps = [t for t in texts if " all-gather(" in t]
    assert steps, f"no optimized program in {hlo} gathers ({len(texts)} programs)"
    return max(steps, key=len)


def _groups(text: str, opcode: str) -> list:
    return re.findall(rf" {opcode}\([^\n]*?replica_groups=(\{{[{{}}0-9,]*\}})", text)


def _shapes(text: str, opcode: str, groups: str) -> list:
    return sorted(re.findall(rf"= (\w+\[[0-9,]*\])[^\n]* {opcode}\([^\n]*replica_groups={re.escape(groups)}", text))


def _elements(text: str, opcode: str, groups: str) -> list:
    """Element counts of the results (a shard may be scattered as rows and all-reduced flat)."""
    return sorted(math.prod(int(d) for d in s.split("[")[1].rstrip("]").split(",") if d)
                  for s in _shapes(text, opcode, groups))


def test_the_losses_are_one_devices(runs):
    want = [loss for _, loss in runs["one_device"][0]["losses"]]
    assert len(want) == 6
    for name in ("one_slice", "collectives_2_slices", "gspmd_2_slices", "rings_2_slices", "staged_2_slices"):
        report = runs[name][0]
        assert report["devices"] == 8 and report["global_batch"] == GLOBAL_BATCH, report
        got = [loss for _, loss in report["losses"]]
        for step, (a, b) in enumerate(zip(got, want), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs one device's {b}"
    assert runs["gspmd_2_slices"][0]["engine"] == "spmd" and runs["collectives_2_slices"][0]["engine"] == "collectives"


@pytest.mark.parametrize("name", ["collectives_2_slices", "gspmd_2_slices"])
def test_parameters_are_gathered_within_a_slice(runs, name):
    text = _step_program(runs[name][1])
    gathers, scatters = _groups(text, "all-gather"), _groups(text, "reduce-scatter")
    assert gathers and set(gathers) == {SLICE_GROUPS}, set(gathers)
    assert set(scatters) <= {SLICE_GROUPS}, set(scatters)
    across = _groups(text, "all-reduce")
    assert ACROSS in across, f"{name}: no gradient all-reduced across the slices: {set(across)}"
    if name == "collectives_2_slices":
        # each scattered gradient shard, all-reduced across the slices once; nothing else crosses
        # them but scalars and the loss
        assert _elements(text, "all-reduce", ACROSS) == _elements(text, "reduce-scatter", SLICE_GROUPS)
        big = [s for s in _shapes(text, "all-reduce", ALL) if not s.endswith("[]")]
        assert not big, f"all-reduced over every device: {big}"


def test_staged_reduce_scatters_run_along_each_slices_own_torus(runs):
    """On a slice whose torus is known, each slice's gradients are reduce-scattered one torus axis
    at a time (torus.each_slice), every stage's groups within one slice, as on one slice; each
    shard is still all-reduced across the slices. Without it HSDP reduce-scattered flat."""
    text = _step_program(runs["staged_2_slices"][1])
    scatters = set(_groups(text, "reduce-scatter"))
    staged = {"{{0,2},{1,3},{4,6},{5,7}}", "{{0,1},{2,3},{4,5},{6,7}}"}  # along y, then x, in both slices
    assert staged <= scatters <= staged | {SLICE_GROUPS}, scatters  # (a bucket too small for rows: flat)
    assert ACROSS in _groups(text, "all-reduce")


def test_rings_stay_within_each_slice(runs):
    """[Note: rings within each slice]: every permute of the ring gathers and reduce-scatters pairs
    devices of one slice, and each gradient shard is still all-reduced across the slices."""
    text = _largest_program(runs["rings_2_slices"][1])
    pairs = re.findall(r" collective-permute(?:-start)?\([^\n]*?source_target_pairs=(\{[{}0-9,]*\})", text)
    assert pairs, "no collective-permute: the rings did not run"
    for p in set(pairs):
        for a, b in re.findall(r"\{(\d+),(\d+)\}", p):
            assert int(a) // 4 == int(b) // 4, f"a permute leaves its slice: {p}"
    assert ACROSS in _groups(text, "all-reduce")
    assert not _groups(text, "all-gather"), "rings replace the gathers"


def _largest_program(hlo: Path) -> str:
    return max((Path(f).read_text() for f in glob.glob(str(hlo / "*after_optimizations.txt"))), key=len)


def test_one_slice_gathers_over_every_device(runs):
    # the control: without the variable the same job gathers over all 8 devices
    assert set(_groups(_step_program(runs["one_slice"][1]), "all-gather")) == {ALL}


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_a_checkpoint_resumes_at_another_number_of_slices(runs, name):
    """checkpoint-3, written once by the replicas of a 2-slice run (or by one slice), resumes at
    the other number of slices: steps 4-6 log the uninterrupted run's losses."""
    want = dict(runs[RESUMED[name][3]][0]["losses"])
    got = dict(runs[name][0]["losses"])
    assert sorted(got) == [4, 5, 6], got
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-5 * abs(want[step]), f"{name} step {step}: {loss} vs {want[step]}"


def test_a_mesh_across_slices_is_refused_and_fsdpv2s_hybrid_layout_trains():
    """tests/fixtures/multislice_meshes.py on 2 slices of 4: FSDPv2's, the collective engine's and
    the GSPMD engine's doors refuse a 1-D mesh over all 8 devices (its gathers would cross the
    DCN), naming the mesh to give; FSDPv2 over ("data", "fsdp") with extra_data_axis="data"
    trains 3 steps as plain PyTorch does, parameters split within a slice."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", MEGASCALE_NUM_SLICES="2",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "multislice_meshes.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    for door in ("fsdpv2_flat", "collectives_flat", "gspmd_flat"):
        assert out[door].startswith("ValueError: ") and "spans 2 slices" in out[door], (door, out[door])
        assert "axes ('data', 'fsdp')" in out[door], out[door]
    for a, b in zip(out["losses"]["fsdpv2_hybrid"], out["losses"]["pytorch"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), out["losses"]
    # split over "fsdp" (4 within a slice), replicated along "data" (the slices)
    assert out["weight_spec"] == "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}", out["weight_spec"]


@pytest.mark.parametrize("config", ["tiny_cpu.json", "tiny_cpu_v2.json"], ids=["collectives", "gspmd"])
def test_the_check_compiles_for_two_slices_and_splits_ici_and_dcn(tmp_path, config):
    """`python -m xla_fsdp.aot --tpu v4-8 --num_slices 2` on the tiny job: libtpu compiles one
    program over 2 x 4 chips; the cross-slice traffic is its megascale transfers ([Note: DCN
    transfers in libtpu's program]): one fp32 gradient shard per chip at most (x1.25 for
    padding), the ICI collectives stay within a slice, and the report prints both."""
    cmd = [sys.executable, "-m", "xla_fsdp.aot", "--tpu", "v4-8", "--num_slices", "2", "--json",
           "--dump", str(tmp_path / "dump"), "--",
           str(ROOT / "launch" / "run_clm.py"), "--config_name", str(ROOT / "configs" / "models" / "gpt2-tiny.json"),
           "--per_device_train_batch_size", "4", "--block_size", "64", "--fsdp", "full_shard auto_wrap",
           "--fsdp_config", str(ROOT / "configs" / "fsdp" / config), "--output_dir", str(tmp_path / "out"),
           "--do_train"]
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("MEGASCALE_NUM_SLICES", None)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    gspmd = config == "tiny_cpu_v2.json"
    assert report["compiles"] and report["slices"] == 2 and report["chips"] == 8 and report["hosts"] == 2
    from transformers import GPT2Config

    from xla_fsdp.metrics import gpt2_num_params
    shard = gpt2_num_params(GPT2Config.from_json_file(str(ROOT / "configs" / "models" / "gpt2-tiny.json"))) * 4 / 4
    d = report["dcn"]
    assert d["transfers"] > 0 and 0.9 * shard <= d["bytes_per_chip"] <= 1.25 * shard, (d, shard)
    assert set(d["by_type"]) == {"ALL_REDUCE"}, d["by_type"]  # no parameter gathered over the DCN
    assert d["sent_per_chip"] == d["bytes_per_chip"]  # an all-reduce over 2 slices sends its buffer once
    assert report["runtime"] == "single_controller" and (report["program"] == "spmd")
    assert d["projected_seconds"] >= report["projection"]["projected_seconds"] and d["in_loops"] == 0
    if not gspmd:  # [Note: cross-slice all-reduces in the backward]: 0.53 of the step; 0.69 without the barriers
        assert d["first_send_fraction"] < 0.6, d["first_send_fraction"]
    # the single controller's rings ([Note: rings within each slice]): permutes within a slice; the
    # other ICI collectives over one slice's 4 chips
    kinds = {c["kind"] for c in report["collective_list"]}
    assert gspmd or "collective-permute" in kinds, kinds
    assert {c["group_size"] for c in report["collective_list"] if c["kind"] != "collective-permute"} <= {4}
    tpu = (tmp_path / "dump" / "tpu_optimized.hlo.txt").read_text()
    if not gspmd:  # [Note: the loss before the backward's reductions]: computed before the DCN's first send
        loss, first_send = _loss_and_first_send(tpu)
        assert loss < first_send, (loss, first_send)
    pairs = set(re.findall(r"source_target_pairs=\{([{}0-9,]*)\}", tpu))
    assert (gspmd or pairs) and all(int(a) // 4 == int(b) // 4 for p in pairs
                                    for a, b in re.findall(r"\{(\d+),(\d+)\}", p))
    from xla_fsdp.aot.report import render

    text = render(report)
    assert "between the 2 slices (DCN" in text and "PROJECTED at 50.0 Gbit/s of DCN per chip" in text, text[-1500:]


def _loss_and_first_send(tpu: str):
    """Schedule positions in the TPU program's entry: the last instruction of the loss (PyTorch's
    nll_loss, which reads the logits) and the first cross-slice send."""
    from xla_fsdp.tpu import dcn, optimized_hlo

    entry = optimized_hlo.computations(tpu)["ENTRY"]
    loss = [i for i, ins in enumerate(entry) if 'op_type="aten__nll_loss"' in ins.rest]
    assert loss, "no loss found in the program"
    return max(loss), min(t.position for t in dcn.transfers(tpu))


def test_sharding_across_slices_gathers_over_the_dcn(tmp_path):
    """The way to shard across slices instead (sharding_groups of every device): the check's
    program then gathers parameters and reduce-scatters gradients over the DCN (libtpu's
    ALL_GATHER and REDUCE_SCATTER transfers), which the HSDP default never does."""
    config = dict(json.loads((ROOT / "configs" / "fsdp" / "tiny_cpu.json").read_text()))
    config["xla_fsdp_settings"] = {**config["xla_fsdp_settings"], "sharding_groups": [list(range(8))]}
    (tmp_path / "across.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "xla_fsdp.aot", "--tpu", "v4-8", "--num_slices", "2", "--json", "--",
           str(ROOT / "launch" / "run_clm.py"), "--config_name", str(ROOT / "configs" / "models" / "gpt2-tiny.json"),
           "--per_device_train_batch_size", "4", "--block_size", "64", "--fsdp", "full_shard auto_wrap",
           "--fsdp_config", str(tmp_path / "across.json"), "--output_dir", str(tmp_path / "out"), "--do_train"]
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("MEGASCALE_NUM_SLICES", None)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    d = json.loads(proc.stdout)["dcn"]
    assert {"ALL_GATHER", "REDUCE_SCATTER"} <= set(d["by_type"]), d["by_type"]
