"""A SIGTERM to the launcher becomes a checkpoint at the end of the step, the job exits 75, and
the same command resumes the uninterrupted run's losses (issue 81 items 1-2; [Note: a signal
becomes a checkpoint] in xla_fsdp/checkpoint/preemption.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from xla_fsdp.checkpoint.preemption import EXIT_PREEMPTED, Preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "models", "gpt2-tiny.json")
STEPS = 40
SIGNAL_AT = 12  # the signal goes once the job logged this step (the issue: 12 or later of 40)
EXIT_WITHIN_S = 30.0
FLAGS = ["--config_name", TINY, "--do_train", "--fsdp", "full_shard auto_wrap", "--max_steps", str(STEPS),
         "--per_device_train_batch_size", "2", "--block_size", "32", "--logging_steps", "1",
         "--warmup_steps", "2", "--save_strategy", "no"]
GSPMD = ["--fsdp_config", os.path.join(ROOT, "configs", "fsdp", "tiny_cpu_v2.json")]


# the launcher's one-process-per-chip path (a TPU's --per_chip) through the real process pool: on
# CPU, torch_xla's spawn starts one replica process of one device (tests/fixtures/spawn_pool_driver.py)
PER_CHIP = [os.path.join(ROOT, "tests", "fixtures", "spawn_pool_driver.py")]


def _command(out, extra=(), per_chip=False):
    launcher = PER_CHIP if per_chip else [os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", "4"]
    return [sys.executable, *launcher, os.path.join(ROOT, "launch", "run_clm.py"), "--output_dir", str(out), *FLAGS,
            *extra]


def _env(per_chip=False):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONUNBUFFERED="1")
    for name in ("CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FSDP_RUNTIME"):
        env.pop(name, None)
    if per_chip:
        env["CPU_NUM_DEVICES"] = "1"
    return env


def _losses(out) -> dict:
    with open(os.path.join(out, "metrics.json")) as f:
        return {int(step): loss for step, loss in json.load(f)["losses"]}


def _at_signal_step(line: str) -> bool:
    got = re.search(rf"step (\d+)/{STEPS} loss", line)
    return bool(got) and int(got.group(1)) >= SIGNAL_AT


def _preempt(out, extra=(), per_chip=False, when=_at_signal_step):
    """The job started, SIGTERM to the launcher at the first line `when` accepts (default: once it
    logged SIGNAL_AT); (exit status, output, seconds from the signal to the exit)."""
    proc = subprocess.Popen(_command(out, extra, per_chip), env=_env(per_chip), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines, signalled = [], None
    timer = threading.Timer(600, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if signalled is None and when(line):
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
        proc.wait()
    finally:
        timer.cancel()
    assert signalled is not None, "".join(lines[-40:])
    return proc.returncode, "".join(lines), time.monotonic() - signalled


def _check_preempted_and_resumed(tmp_path, extra=(), per_chip=False):
    whole = tmp_path / "whole"
    done = subprocess.run(_command(whole, extra, per_chip), env=_env(per_chip), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    want = _losses(whole)
    assert sorted(want) == list(range(1, STEPS + 1))

    cut = tmp_path / "cut"
    code, output, took = _preempt(cut, extra, per_chip)
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert took < EXIT_WITHIN_S, f"{took:.1f} s from the signal to the exit"
    saved = sorted(int(p.name.split("-")[1]) for p in cut.iterdir() if p.name.startswith("checkpoint-"))
    assert len(saved) == 1 and SIGNAL_AT <= saved[0] < STEPS, saved
    step = saved[0]
    assert (cut / f"checkpoint-{step}" / "COMPLETE").exists()
    with open(cut / "metrics.json") as f:
        assert json.load(f)["preempted"]["step"] == step
    assert f"stopped by SIGTERM signal at step {step}" in output and "run the same command again" in output, output
    assert "Traceback" not in output, output
    if per_chip:  # the launcher passed the signal on and waited, not stopped the replica
        assert "SIGTERM passed on to the 1 replica processes" in output, output[-3000:]
        assert "replica 0 saved the checkpoint the signal asked for; exit status 75" in output, output[-3000:]

    again = subprocess.run(_command(cut, extra, per_chip), env=_env(per_chip), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout and f"checkpoint-{step}" in again.stdout, again.stdout[-2000:]
    got = _losses(cut)
    assert sorted(got) == list(range(step + 1, STEPS + 1)), sorted(got)
    for s, loss in got.items():
        assert loss == pytest.approx(want[s], rel=1e-5), (s, loss, want[s])


def test_sigterm_saves_at_the_step_boundary_and_the_same_command_resumes(tmp_path):
    """The collective engine under the single controller at 4 devices."""
    _check_preempted_and_resumed(tmp_path)


@pytest.mark.slow
def test_the_same_with_the_gspmd_engine(tmp_path):
    _check_preempted_and_resumed(tmp_path, GSPMD)


# -m slow (24 s): in the default run, the launcher passing SIGTERM on in the spawn path
# (tests/test_launcher.py) and a Preemption entered on a replica's thread hearing it (below)
@pytest.mark.slow
def test_the_same_with_one_process_per_chip(tmp_path):
    """The launcher's spawn path (--per_chip on a TPU): the SIGTERM reaches the launcher only; it
    passes it on to the replica and waits; the replica saves and returns, the launcher exits 75."""
    _check_preempted_and_resumed(tmp_path, per_chip=True)


def test_a_signal_before_the_first_step_ends_saves_nothing_and_says_so(tmp_path):
    """SIGTERM once the job has started (its first log line), while it sets up or compiles its first
    step: exit 75 within the bound, no checkpoint, a message saying so and how to go on."""
    out = tmp_path / "early"
    code, output, took = _preempt(out, when=lambda line: line.startswith("run_clm:"))
    assert " loss " not in output.split("run_clm:", 1)[0], output[-3000:]  # signalled before any step
    assert code == EXIT_PREEMPTED and took < EXIT_WITHIN_S, output[-3000:]
    assert "nothing saved; run the same command again" in output and "Traceback" not in output, output[-3000:]
    assert not any(p.name.startswith("checkpoint-") for p in out.iterdir()), sorted(out.iterdir())
    with open(out / "metrics.json") as f:
        assert json.load(f)["preempted"]["checkpoint"] is None


def test_a_second_signal_within_the_grace_period_does_not_cut_the_save(capsys):
    """In one process: the first SIGTERM sets the flag, a second within the grace period is said
    and ignored (the process lives on), and the handlers before the block come back after it."""
    said = []
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(grace_s=30, say=said.append) as preempted:
        assert not preempted.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempted.requested and preempted.agreed() and preempted.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
    assert len(said) == 2 and "saving a checkpoint" in said[0] and "being saved" in said[1], said


def test_a_grace_period_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="grace_s=0"):
        Preemption(grace_s=0)


def test_a_preemption_entered_off_the_main_thread_hears_the_signal_through_the_replicas_handler():
    """[Note: a replica's signals]: torch_xla's spawn runs a replica on a thread; the handler installed
    on the main thread when the replica is unpickled hands SIGTERM to the Preemption entered there."""
    from xla_fsdp.runtime import signals

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    got = {}
    try:
        signals.listen_on_main_thread()
        assert signals.delivered((signal.SIGTERM,))

        def replica():
            with Preemption(say=lambda line: None) as preempted:
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 10
                while not preempted.requested and time.monotonic() < deadline:
                    time.sleep(0.01)  # the main thread runs the handler
                got["requested"] = preempted.requested

        thread = threading.Thread(target=replica)
        thread.start()
        thread.join(30)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert got == {"requested": True}
