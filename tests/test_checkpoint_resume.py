"""Preemption: train k steps, save, SIGKILL; resume and train k more = one uninterrupted run.

Each runtime runs tests/fixtures/resume_job.py three times: uninterrupted for
6 steps; 3 steps, a complete save, then SIGKILL; and a fresh process that
resumes from the newest complete checkpoint (model, AdamW state, LR scheduler,
data position) to step 6. The losses of the interrupted pair must equal the
uninterrupted run's (fp32, 1e-5 relative; in practice bit-equal). Runtimes: the
collective engine on gloo world 2, on XLA world 1 and in the single-controller
runtime (4 devices, GPT-2), and the GSPMD engine (4 devices).

Crash safety: a process killed in the middle of writing a checkpoint's tensor
file leaves the previous checkpoint loadable; "latest" skips the partial one
and the resumed run continues the same loss curve.
"""
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "fixtures" / "resume_job.py"

RUNTIMES = {  # runtime -> (extra job args, devices)
    "gloo": ([], 1),
    "xla1": ([], 1),
    "single": (["--model", "gpt2"], 4),
    "gspmd": (["--model", "mlp"], 4),
}


def _run(runtime: str, root: Path, out: Path, *flags, expect_kill=False):
    extra, devices = RUNTIMES[runtime]
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    env.pop("XLA_USE_SPMD", None)
    base = [sys.executable, str(JOB), "--runtime", runtime, "--root", str(root), "--out", str(out), *extra, *flags]
    if runtime == "gloo":
        store = str(root.parent / f"store-{uuid.uuid4().hex}")
        procs = [subprocess.Popen(base + ["--rank", str(r), "--world", "2", "--store", store], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    else:
        procs = [subprocess.Popen(base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    for p in procs:
        log, _ = p.communicate(timeout=900)
        if expect_kill:
            assert p.returncode == -signal.SIGKILL, f"expected SIGKILL, got {p.returncode}:\n{log[-3000:]}"
        else:
            assert p.returncode == 0, log[-4000:]


def _losses(path: Path):
    return {rec["step"]: rec for rec in map(json.loads, path.read_text().splitlines())}


# gloo in the default run; XLA world 1, the single controller and the GSPMD engine under -m slow
# (their resume paths are also crossed by tests/test_checkpoint_reshard.py, and the single
# controller's kill-and-resume on hosts by tests/test_pod_checkpoints.py)
@pytest.mark.parametrize("runtime", [pytest.param(r, marks=pytest.mark.slow) if r in ("xla1", "gspmd", "single")
                                     else r for r in RUNTIMES])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, runtime):
    _run(runtime, tmp_path / "whole", tmp_path / "whole.jsonl")
    _run(runtime, tmp_path / "split", tmp_path / "split.jsonl", "--kill-after-save", "3", expect_kill=True)
    assert sorted(_losses(tmp_path / "split.jsonl")) == [0, 1, 2]
    _run(runtime, tmp_path / "split", tmp_path / "split.jsonl")
    whole, split = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "split.jsonl")
    assert sorted(whole) == sorted(split) == list(range(6))
    for step in range(6):
        assert split[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5), step
        assert split[step]["lr"] == whole[step]["lr"], step  # the scheduler resumed too


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    from xla_fsdp.checkpoint import latest_checkpoint

    root = tmp_path / "run"
    _run("xla1", tmp_path / "whole", tmp_path / "whole.jsonl", "--save-every", "2")
    _run("xla1", root, tmp_path / "crash.jsonl", "--save-every", "2", "--crash-in-save", "4", expect_kill=True)
    names = sorted(os.listdir(root))
    assert names == ["checkpoint-2", "checkpoint-4.partial"], names
    partial = root / "checkpoint-4.partial"
    shard = partial / "shards-rank00000.safetensors"
    assert shard.exists() and not (partial / "COMPLETE").exists()  # killed inside the tensor file
    assert latest_checkpoint(str(root)) == str(root / "checkpoint-2")
    _run("xla1", root, tmp_path / "crash.jsonl", "--save-every", "2")
    whole, resumed = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "crash.jsonl")
    # steps 2 and 3 ran twice (before the crash and after the resume), the same both times
    for step in range(6):
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5), step
    assert sorted(os.listdir(root)) == ["checkpoint-4", "checkpoint-6"]  # partial cleared, last 2 kept
