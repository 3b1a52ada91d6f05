"""Saves written beside training (issue 81 item 3; [Note: saves beside training] in
xla_fsdp/checkpoint/save.py): the step that saves waits only for the host copy, the files are
written while training goes on, the COMPLETE marker comes at the commit, and a write that fails
or a job killed mid-write leaves the previous checkpoint the one that resumes. XLA world 1."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint_cases as cc
from gcs_emulator import gcs_emulator  # noqa: F401 (fixture)
from xla_fsdp.checkpoint import CheckpointManager, CheckpointWriteError, Preemption, latest_checkpoint, load_checkpoint
from xla_fsdp.checkpoint.format import is_complete, shard_file

torch_xla = pytest.importorskip("torch_xla")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(model, opt, steps):
    cc.train(model, opt, "mlp_nested", steps, device=torch_xla.device(), sync=torch_xla.sync)


def _state(model, opt):
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    moments = {i: s["exp_avg"].detach().cpu().clone() for i, s in opt.state_dict()["state"].items()}
    return params, moments


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in b:
            assert torch.equal(a[k], b[k]), k


def test_a_save_beside_training_holds_its_step_and_commits_at_a_boundary(tmp_path):
    model, opt = cc.wrapped("mlp_nested", "adamw", {})
    _train(model, opt, range(2))
    at_save = _state(model, opt)
    manager = CheckpointManager(str(tmp_path), async_save=True)
    path = manager.save(2, model, opt)
    assert not is_complete(path)  # only a step boundary (poll) or wait commits it
    _train(model, opt, range(2, 4))  # the next steps change every parameter and moment
    assert not any(torch.equal(a, b) for a, b in zip(_state(model, opt)[0].values(), at_save[0].values()))
    deadline = time.time() + 60
    while manager.poll() is None:
        assert time.time() < deadline, "the save beside training never committed"
        time.sleep(0.01)
    assert is_complete(path) and latest_checkpoint(str(tmp_path)) == path
    fresh, fresh_opt = cc.wrapped("mlp_nested", "adamw", {}, seed=3)
    _train(fresh, fresh_opt, range(1))
    load_checkpoint(path, fresh, fresh_opt)
    _assert_same(_state(fresh, fresh_opt), at_save)  # the step it was taken at, not the step it was written at


def test_a_host_tensor_shared_with_training_is_copied_at_the_save():
    """A model on the CPU device hands the save its own storage; the copy taken at the save is not it."""
    from xla_fsdp.checkpoint.save import _copied

    weight = torch.ones(4)
    produce = _copied(weight, {weight.untyped_storage().data_ptr()})
    weight.add_(1)  # training goes on
    assert torch.equal(produce(), torch.ones(4))
    other = torch.ones(4)
    assert _copied(other, set())() is other  # a copy already made is not copied again


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root can mount one here; skipped where it cannot)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {got.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_during_the_write_is_named_and_the_previous_checkpoint_stays(small_disk):
    model, opt = cc.wrapped("mlp_nested", "adamw", {})
    _train(model, opt, range(1))
    manager = CheckpointManager(str(small_disk), async_save=True)
    first = manager.save(1, model, opt)
    manager.wait()
    used = sum(f.stat().st_size for f in (small_disk / "checkpoint-1").iterdir())
    filler = small_disk / "filler"  # leave less than one more checkpoint's room
    filler.write_bytes(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - used // 2))
    _train(model, opt, range(1, 2))
    manager.save(2, model, opt)
    with pytest.raises(CheckpointWriteError, match="checkpoint-2") as failed:
        manager.wait()
    assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == errno.ENOSPC
    assert "No space left on device" in str(failed.value)
    assert sorted(p.name for p in small_disk.iterdir()) == ["checkpoint-1", "filler"]  # nothing half-written
    assert latest_checkpoint(str(small_disk)) == first
    load_checkpoint(first, *cc.wrapped("mlp_nested", "adamw", {}, seed=3))


def test_sigkill_while_the_files_are_written_leaves_the_previous_checkpoint(gcs_emulator, tmp_path):  # noqa: F811
    """checkpoint-2's tensor file is held in the bucket's upload (tests/gcs_emulator.py) while the job
    trains on; the job is SIGKILLed there: checkpoint-1 is the newest complete one and loads."""
    root = gcs_emulator.fresh("async")
    with gcs_emulator.hold_upload("checkpoint-2/" + shard_file(0)) as held:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fixtures", "async_save_job.py"), root],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PJRT_DEVICE="CPU"))
        try:
            deadline = time.time() + 300
            while not held.wait(0.1):
                assert proc.poll() is None and time.time() < deadline, \
                    f"checkpoint-2's upload never started:\n{proc.stdout.read()[-3000:] if proc.poll() is not None else ''}"
            lines = []
            for line in proc.stdout:  # training goes on while the write hangs
                lines.append(line)
                if line.startswith("step 4"):
                    break
            assert lines and lines[-1].startswith("step 4"), "".join(lines)[-3000:]
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert latest_checkpoint(root) == root.rstrip("/") + "/checkpoint-1"
    load_checkpoint(latest_checkpoint(root), *cc.wrapped("mlp_nested", "adamw", {}, seed=3))


def test_a_signal_during_a_save_beside_training_saves_the_next_boundary_too(tmp_path):
    """SIGTERM while a periodic save is under way (begun, not committed): the next boundary agrees to
    stop, and the save of that step first commits the one under way: both are complete."""
    model, opt = cc.wrapped("mlp_nested", "adamw", {})
    manager = CheckpointManager(str(tmp_path), async_save=True)
    with Preemption(say=lambda line: None) as preempted:
        for step in range(1, 10):
            _train(model, opt, [step])
            if preempted.agreed():
                manager.save(step, model, opt)
                manager.wait()
                break
            if step == 2:
                manager.save(step, model, opt)
                os.kill(os.getpid(), signal.SIGTERM)  # checkpoint-2 is not committed yet: no boundary since
                assert not is_complete(str(tmp_path / "checkpoint-2"))
            manager.poll()
    assert step == 3 and latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert is_complete(str(tmp_path / "checkpoint-2"))
