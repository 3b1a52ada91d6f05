"""Profiles of chosen steps and TensorBoard (issue 83 items 1-2): run_clm's --profile_steps A-B
writes torch_xla's profiler trace of those steps under OUTPUT_DIR/profile, readable by
TensorBoard's profile plugin (an .xplane.pb per capture), and the capture compiles nothing the run
without it does not; --report_to tensorboard writes each logging step's record as scalars under
OUTPUT_DIR/runs/, the values of metrics.json's "logged"."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from gcs_emulator import gcs_emulator  # noqa: F401 (fixture)
from xla_fsdp.profiling import parse_range

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--config_name", os.path.join(ROOT, "configs", "models", "gpt2-tiny.json"), "--do_train", "--fsdp",
         "full_shard auto_wrap", "--max_steps", "6", "--per_device_train_batch_size", "2", "--block_size", "32",
         "--logging_steps", "1", "--warmup_steps", "1"]


def _run(out, *extra):
    env = dict(os.environ, PJRT_DEVICE="CPU")
    for name in ("CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FSDP_RUNTIME"):
        env.pop(name, None)
    got = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", "4",
                          os.path.join(ROOT, "launch", "run_clm.py"), "--output_dir", str(out), *FLAGS, *extra],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f), got.stdout + got.stderr


def test_steps_3_to_4_are_traced_under_output_dir_and_compile_nothing_more(tmp_path):
    """The tiny job at 4 devices with --report_to tensorboard --profile_steps 3-4 (the issue's
    acceptance run), against the same job with neither."""
    plain, _ = _run(tmp_path / "plain")
    traced, said = _run(tmp_path / "traced", "--profile_steps", "3-4", "--report_to", "tensorboard")
    planes = glob.glob(str(tmp_path / "traced" / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(planes) == 1 and os.path.getsize(planes[0]) > 0, os.listdir(tmp_path / "traced")
    assert "profile of steps 3-4 written to" in said, said[-2000:]
    assert not (tmp_path / "plain" / "profile").exists()
    assert traced["xla_compiles"] == plain["xla_compiles"], (traced["xla_compiles"], plain["xla_compiles"])
    assert traced["losses"] == plain["losses"]  # the same program on the same data
    _check_scalars(tmp_path / "traced", traced)


@pytest.mark.parametrize("text", ["3", "4-3", "0-2", "a-b", "3-"])
def test_a_range_that_is_not_a_to_b_is_refused_naming_the_form(text):
    with pytest.raises(ValueError, match="as A-B with 1 <= A <= B"):
        parse_range(text)
    assert parse_range(" 2-5 ") == (2, 5)


def test_a_bucket_folder_gets_the_trace_copied_when_it_stops(gcs_emulator):  # noqa: F811
    """At a URL the trace is written to a local folder, then copied there (tests/gcs_emulator.py)."""
    import torch
    import torch_xla

    from xla_fsdp.profiling import ProfileSteps

    url = gcs_emulator.fresh("profile")
    said = []
    profile = ProfileSteps(url, 1, 1, say=said.append)
    profile.before(1)
    x = torch.ones(8, 8, device=torch_xla.device())
    (x @ x).sum().item()
    profile.after(1)
    names = [n for n in gcs_emulator.objects(url) if n.endswith(".xplane.pb")]
    assert len(names) == 1 and said and url in said[0], (names, said)


def test_host_0_profiles_unless_every_host_is_asked_each_into_its_own_folder():
    from xla_fsdp.profiling import ProfileSteps

    assert ProfileSteps("p", 1, 2).active and ProfileSteps("p", 1, 2).folder == "p"
    assert not ProfileSteps("p", 1, 2, host=1).active
    every = ProfileSteps("p", 1, 2, host=1, all_hosts=True)
    assert every.active and every.folder == os.path.join("p", "host-1")


def _scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(os.path.join(folder, "runs", "*"))
    assert len(runs) == 1, runs
    events = EventAccumulator(runs[0])
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _check_scalars(out, got: dict) -> None:
    """Each figure of each logging step, read back from the event files, equals metrics.json's
    record (float32 in the events); the norm that --max_grad_norm (default 1.0) clips is among
    them, and memory in use."""
    scalars = _scalars(out)
    logged = got["logged"]
    assert [r["step"] for r in logged] == list(range(1, 7))
    want = {"loss", "learning_rate", "memory_bytes", "grad_norm", "tokens_per_s", "step_time_s", "mfu"}
    assert {t.split("/", 1)[1] for t in scalars} == want and all(t.startswith("train/") for t in scalars)
    for record in logged:
        for name, value in record.items():
            if name != "step":
                assert scalars[f"train/{name}"][record["step"]] == pytest.approx(value, rel=1e-6), (name, record)
    assert [[r["step"], r["loss"]] for r in logged] == got["losses"]
    assert all(r["memory_bytes"] > 2**20 and r["grad_norm"] > 0 for r in logged)


def test_an_unknown_reporter_is_refused_listing_the_supported(capsys):
    from xla_fsdp.train.args import parse_args

    with pytest.raises(SystemExit) as ended:
        parse_args([*FLAGS, "--output_dir", "x", "--report_to", "wandb"])
    assert ended.value.code == 2
    assert "--report_to wandb: not a reporter this job has; give one of none, tensorboard" in capsys.readouterr().err
