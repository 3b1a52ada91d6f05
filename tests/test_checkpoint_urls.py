"""Checkpoints at fsspec URLs: [Note: commit without rename] (xla_fsdp/checkpoint/save.py).

A URL (`gs://`, `file://`, `memory://`, ...) goes through fsspec; its save writes straight
into the checkpoint's directory and commits by writing COMPLETE last. Here fsspec's local
file system (`file://` under tmp_path) and its in-memory one (`memory://`) stand for a bucket.

A gloo world of 2 (one process per chip) trains the parity MLP K steps under a
CheckpointManager at a file:// root (keep_last=2), saves the last step twice, fails a save
on rank 1 only, and resumes from the newest complete checkpoint in a differently seeded
model: its losses and parameters must equal the unsharded reference's uninterrupted run,
and the offline consolidation of the URL must hold the reference's parameters after K steps.
Single-process tests (a plain model: world 1) cover the order of removals (marker first),
crashes in the middle of an overwrite or a rotation, failed saves, and the missing-package error.
"""
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

import checkpoint_cases as cc
from parity_cases import assert_rel_close, run_distributed_fn
from xla_fsdp.checkpoint import (CheckpointError, CheckpointManager, CheckpointWriteError, complete_checkpoints,
                                 consolidate, latest_checkpoint, load_checkpoint, save_checkpoint)
from xla_fsdp.checkpoint import format as fmt
from xla_fsdp.checkpoint import storage

KIND, OPTIM = "mlp_nested", "adamw"
RANK_FILES = ["extra-rank{:05d}.pt", "index-rank{:05d}.json", "shards-rank{:05d}.safetensors"]


# -- gloo world 2 ---------------------------------------------------------------------

def _gloo_worker(rank, world, tmp, root):
    model, opt = cc.wrapped(KIND, OPTIM, cc.Layout("FULL_SHARD").kwargs(world))
    manager = CheckpointManager(root, keep_last=2)
    losses = []
    for step in range(cc.K):
        losses += cc.train(model, opt, KIND, [step], rank, world)
        manager.save(step + 1, model, opt, extra_state={"losses": list(losses)})
    manager.save(cc.K, model, opt, extra_state={"losses": list(losses)})  # the same step again
    record = {"before_failure": [p for _, p in complete_checkpoints(root)]}

    st = storage.storage_for(root)
    real = st.open_write

    def failing(path):
        if path.endswith(".safetensors"):
            raise OSError(28, f"No space left on device (injected): {path}")
        return real(path)

    if rank == 1:  # only rank 1 cannot write its tensor file
        st.open_write = failing
    try:
        manager.save(cc.K + 1, model, opt)
        record["failure"] = None
    except CheckpointWriteError as e:
        record["failure"] = str(e)
    finally:
        st.open_write = real
    record["latest"] = manager.latest()
    record["after_failure"] = [p for _, p in complete_checkpoints(root)]

    model2, opt2 = cc.wrapped(KIND, OPTIM, cc.Layout("FULL_SHARD").kwargs(world), seed=7)
    got = load_checkpoint(manager.latest(), model2, opt2)
    record.update(step=got["step"], saved_losses=got["extra"]["losses"],
                  losses=cc.train(model2, opt2, KIND, range(cc.K, cc.K + cc.MORE), rank, world))
    params = cc.full_params(model2)
    torch.save({"record": record, "params": params}, os.path.join(tmp, f"url-rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("urls")
    root = f"file://{tmp}/run"
    run_distributed_fn(_gloo_worker, 2, str(tmp), root)
    out = [torch.load(tmp / f"url-rank{r}.pt", weights_only=False) for r in range(2)]
    return tmp, root, out


def test_save_and_resume_through_a_url_on_gloo_world_2(gloo_run):
    tmp, root, out = gloo_run
    ref = cc.reference(KIND, OPTIM, cc.K + cc.MORE)
    for rank, got in enumerate(out):
        rec = got["record"]
        assert rec["latest"] == f"{root}/checkpoint-{cc.K}"
        assert rec["step"] == cc.K
        torch.testing.assert_close(torch.tensor(rec["saved_losses"]), torch.tensor(ref["losses"][:cc.K]),
                                   rtol=1e-5, atol=1e-6)  # extra state: torch.save/load through fsspec
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"][cc.K:]),
                                   rtol=1e-5, atol=1e-6)
        for name, want in ref["params"].items():
            assert_rel_close(got["params"][name], want, 1e-5, f"rank {rank}: {name}")
    # written in place (no .partial, no rename), committed by the marker, every rank's files there
    run = tmp / "run"
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-3"]
    for name in os.listdir(run):
        want = sorted([fmt.COMPLETE, fmt.METADATA] + [f.format(r) for f in RANK_FILES for r in range(2)])
        assert sorted(os.listdir(run / name)) == want
        assert json.loads((run / name / fmt.METADATA).read_text())["world_size"] == 2


def test_rotation_and_a_save_that_fails_on_one_rank(gloo_run):
    tmp, root, out = gloo_run
    for got in out:
        rec = got["record"]
        # keep_last=2 under the URL: checkpoint-1 went when checkpoint-3 was written
        assert rec["before_failure"] == [f"{root}/checkpoint-2", f"{root}/checkpoint-3"]
        assert rec["after_failure"] == rec["before_failure"]  # the failed save touched nothing else
    assert "rank 1: " in out[1]["record"]["failure"] and "injected" in out[1]["record"]["failure"]
    assert "another rank failed to write its files" in out[0]["record"]["failure"]
    assert not (tmp / "run" / f"checkpoint-{cc.K + 1}").exists()  # what was written is removed


def test_consolidation_reads_a_url(gloo_run, tmp_path):
    _, root, _ = gloo_run
    from safetensors.torch import load_file

    url = f"{root}/checkpoint-{cc.K}"
    target = consolidate(url, str(tmp_path / "api"))
    ref = cc.reference(KIND, OPTIM, cc.K)["params"]
    got = load_file(target)
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        assert_rel_close(got[name], want, 1e-5, name)
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", url, str(tmp_path / "cli")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(target, "rb") as a, open(tmp_path / "cli" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


# -- one process ----------------------------------------------------------------------

def _plain(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(params=["file", "memory"])
def root(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/run"
        return
    url = f"memory://xla-fsdp-tests/{uuid.uuid4().hex}"
    yield url
    storage.storage_for(url).rmtree(url, ignore_errors=True)


def _log(monkeypatch, ops):
    for name in ("remove", "rmtree", "open_write"):
        real = getattr(storage.FsspecStorage, name)

        def logged(self, path, *args, _real=real, _name=name, **kw):
            ops.append((_name, path))
            return _real(self, path, *args, **kw)

        monkeypatch.setattr(storage.FsspecStorage, name, logged)


def test_a_directory_without_the_marker_is_ignored_and_refused(root, tmp_path):
    model, opt = _plain()
    manager = CheckpointManager(root)
    manager.save(1, model, opt)
    manager.save(2, model, opt)
    st = storage.storage_for(root)
    st.remove(f"{root}/checkpoint-2/{fmt.COMPLETE}")  # as a save killed before its commit leaves it
    assert latest_checkpoint(root) == f"{root}/checkpoint-1"
    assert complete_checkpoints(root) == [(1, f"{root}/checkpoint-1")]
    other, opt2 = _plain(seed=5)
    with pytest.raises(CheckpointError, match=r"checkpoint-2 is not a complete checkpoint \(no COMPLETE marker"):
        load_checkpoint(f"{root}/checkpoint-2", other, opt2)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        consolidate(f"{root}/checkpoint-2", str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="no checkpoint directory at .*checkpoint-7"):
        load_checkpoint(f"{root}/checkpoint-7", other, opt2)
    assert load_checkpoint(manager.latest(), other, opt2)["step"] == 1 and _equal(model, other)


def test_saving_a_step_again_takes_its_marker_away_first(root, monkeypatch):
    model, opt = _plain()
    path = save_checkpoint(f"{root}/checkpoint-3", model, opt, step=3)
    newer, newer_opt = _plain(seed=1)
    ops = []
    _log(monkeypatch, ops)
    save_checkpoint(path, newer, newer_opt, step=3)
    mine = [op for op in ops if op[1].startswith(path)]
    assert mine[:2] == [("remove", f"{path}/{fmt.COMPLETE}"), ("rmtree", path)], mine
    assert mine[-2:] == [("open_write", f"{path}/{fmt.METADATA}"), ("open_write", f"{path}/{fmt.COMPLETE}")]
    loaded, loaded_opt = _plain(seed=9)
    load_checkpoint(path, loaded, loaded_opt)
    assert _equal(loaded, newer) and not _equal(loaded, model)


def test_an_overwrite_that_dies_midway_is_not_taken_for_complete(root, monkeypatch):
    model, opt = _plain()
    manager = CheckpointManager(root)
    manager.save(1, model, opt)
    manager.save(2, model, opt)

    def dies(self, path, ignore_errors=False):  # removing the files fails once the marker went
        if not ignore_errors:
            raise OSError("killed mid-removal (injected)")

    monkeypatch.setattr(storage.FsspecStorage, "rmtree", dies)
    with pytest.raises(CheckpointWriteError, match="could not write checkpoint .*checkpoint-2.*injected"):
        manager.save(2, model, opt)
    monkeypatch.undo()
    st = storage.storage_for(root)
    assert st.isfile(f"{root}/checkpoint-2/{fmt.METADATA}")  # the old files are still there ...
    assert not st.exists(f"{root}/checkpoint-2/{fmt.COMPLETE}")  # ... but not as a checkpoint
    assert latest_checkpoint(root) == f"{root}/checkpoint-1"
    manager.save(2, model, opt)  # the next save of that step clears them
    assert latest_checkpoint(root) == f"{root}/checkpoint-2"


def test_rotation_takes_the_marker_first(root, monkeypatch):
    model, opt = _plain()
    manager = CheckpointManager(root, keep_last=1)
    manager.save(1, model, opt)
    ops = []
    _log(monkeypatch, ops)
    manager.save(2, model, opt)
    old = f"{root}/checkpoint-1"
    assert [op for op in ops if op[1].startswith(old)] == [("remove", f"{old}/{fmt.COMPLETE}"), ("rmtree", old)]
    assert storage.storage_for(root).listdir(root) == ["checkpoint-2"]
    # a crash between the two steps of a rotation leaves files that are no checkpoint
    monkeypatch.setattr(storage.FsspecStorage, "rmtree", lambda self, path, ignore_errors=False: None)
    manager.save(3, model, opt)
    assert storage.storage_for(root).listdir(root) == ["checkpoint-2", "checkpoint-3"]
    assert complete_checkpoints(root) == [(3, f"{root}/checkpoint-3")]


def test_failed_saves_leave_earlier_checkpoints(root, tmp_path, monkeypatch):
    model, opt = _plain()
    manager = CheckpointManager(root)
    manager.save(1, model, opt)
    st = storage.storage_for(root)
    real = storage.FsspecStorage.open_write

    def full_disk(self, path):
        if path.endswith(".safetensors"):
            raise OSError(28, "No space left on device (injected)")
        return real(self, path)

    monkeypatch.setattr(storage.FsspecStorage, "open_write", full_disk)
    for step in (2, 1):  # a new step, and the same step again (its old copy is gone: no rename)
        with pytest.raises(CheckpointWriteError, match=rf"checkpoint-{step} \(rank 0: .*injected"):
            manager.save(step, model, opt)
        assert not st.exists(f"{root}/checkpoint-{step}")
        if step == 2:
            other, other_opt = _plain(seed=4)
            assert load_checkpoint(manager.latest(), other, other_opt)["step"] == 1 and _equal(model, other)
    assert manager.latest() is None
    monkeypatch.undo()
    # a file where a folder of the path should be
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    with pytest.raises(CheckpointWriteError, match="could not write checkpoint file://.*blocked/ckpt"):
        save_checkpoint(f"file://{blocked}/ckpt", model, opt, step=3)
    assert blocked.read_text() == "not a folder"


def test_consolidation_and_export_to_a_url(tmp_path):
    from safetensors.torch import load
    from xla_fsdp.checkpoint import save_pretrained

    model, opt = _plain()
    url = f"memory://xla-fsdp-tests/{uuid.uuid4().hex}"
    st = storage.storage_for(url)
    try:
        path = save_checkpoint(f"{url}/ckpt", model, opt, step=1)
        target = consolidate(path, f"{url}/hf")
        assert target == f"{url}/hf/model.safetensors"
        save_pretrained(model, f"{url}/exported")
        for out in (target, f"{url}/exported/model.safetensors"):
            got = load(st.read_bytes(out))
            assert sorted(got) == sorted(model.state_dict())
            assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    finally:
        st.rmtree(url, ignore_errors=True)


def test_torch_xla_style_rank_files_at_a_url():
    from xla_fsdp import consolidate_sharded_model_checkpoints

    url = f"memory://xla-fsdp-tests/{uuid.uuid4().hex}"
    st = storage.storage_for(url)
    meta = {"format": "xla_fsdp.shard_metadata/1", "world_size": 3, "rank": 0, "shard_groups": [[0, 1, 2]],
            "shard_info": {"w": {"shape": [5], "rows": 5, "rows_per_rank": 2, "tied_to": None}}, "buffer_info": {}}
    try:
        for rank in range(3):
            with st.open_write(f"{url}/c_rank-{rank:08d}-of-00000003.pth") as f:
                torch.save({"model": {"w": torch.arange(2.0) + 2 * rank}, "shard_metadata": dict(meta, rank=rank)}, f)
        full, saved = consolidate_sharded_model_checkpoints(f"{url}/c", "_rank-*-of-*.pth")
        assert torch.equal(full["w"], torch.arange(5.0))
        assert saved == f"{url}/c_consolidated.pth" and st.isfile(saved)
    finally:
        st.rmtree(url, ignore_errors=True)


def test_a_url_without_its_file_system_names_the_package(monkeypatch):
    # a machine without gcsfs, on this one (make test installs it): its import fails, and fsspec
    # forgets any gs:// class it already loaded
    import fsspec  # noqa: F401

    registry = sys.modules["fsspec.registry"]  # the module: fsspec's `registry` name is its read-only view
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    monkeypatch.setattr(registry, "_registry", {k: v for k, v in registry._registry.items() if k not in ("gs", "gcs")})
    model, opt = _plain()
    for call in (lambda: save_checkpoint("gs://some-bucket/run/checkpoint-1", model, opt),
                 lambda: latest_checkpoint("gs://some-bucket/run")):
        with pytest.raises(ImportError, match=r"need gcsfs.*pip install gcsfs \(or pip install xla_fsdp\[gcs\]\)"):
            call()
    with pytest.raises(ValueError, match="no file system for nosuchfs:// URLs"):
        latest_checkpoint("nosuchfs://x/run")
