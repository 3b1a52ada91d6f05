"""Checkpoints that cannot be loaded or saved fail by name, and change nothing (XLA world 1)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import checkpoint_cases as cc
import parity_cases as pc
from xla_fsdp.checkpoint import (CheckpointError, CheckpointWriteError, consolidate, load_checkpoint,
                                 save_checkpoint)

torch_xla = pytest.importorskip("torch_xla")


@pytest.fixture
def trained(tmp_path):
    model, opt = cc.wrapped("mlp_nested", "adamw", {})
    cc.train(model, opt, "mlp_nested", range(2), device=torch_xla.device(), sync=torch_xla.sync)
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, model, opt, step=2)
    return path, model, opt


def _snapshot(model, opt):
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    state = {i: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()}
    return params, state


def _assert_unchanged(model, opt, before):
    params, state = _snapshot(model, opt)
    for name, value in before[0].items():
        assert torch.equal(params[name], value), name
    assert state.keys() == before[1].keys()


def _fresh():
    model, opt = cc.wrapped("mlp_nested", "adamw", {}, seed=3)
    cc.train(model, opt, "mlp_nested", range(1), device=torch_xla.device(), sync=torch_xla.sync)
    return model, opt


def test_checkpoint_of_another_model_is_refused_before_anything_changes(trained):
    path = trained[0]
    model, opt = cc.wrapped("gpt2", "adamw", {})
    cc.train(model, opt, "gpt2", range(1), device=torch_xla.device(), sync=torch_xla.sync)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"is of another model: the model has .*c_attn.bias.*the checkpoint has \['0.bias'"):
        load_checkpoint(path, model, opt)
    _assert_unchanged(model, opt, before)

    import torch.nn as nn

    other = pc.wrap(pc.Case("x", "mlp", "sgd"), nn.Sequential(nn.Linear(32, 66), nn.GELU(),
                                                               nn.Sequential(nn.Linear(66, 67), nn.Tanh()),
                                                               nn.Linear(67, 5)))
    with pytest.raises(CheckpointError, match=r"'0.weight' is \(67, 32\) there and \(66, 32\) here"):
        load_checkpoint(path, other)


def test_truncated_missing_and_corrupt_files_are_named(trained, tmp_path):
    path = trained[0]
    model, opt = _fresh()
    before = _snapshot(model, opt)
    shard = os.path.join(path, "shards-rank00000.safetensors")

    broken = str(tmp_path / "truncated")
    shutil.copytree(path, broken)
    with open(os.path.join(broken, "shards-rank00000.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match=r"truncated.*shards-rank00000\.safetensors"):
        load_checkpoint(broken, model, opt)

    flipped = str(tmp_path / "flipped")
    shutil.copytree(path, flipped)
    with open(os.path.join(flipped, "shards-rank00000.safetensors"), "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x7f" * 8)
    with pytest.raises(CheckpointError, match=r"corrupt.*shards-rank00000\.safetensors.*checksum"):
        load_checkpoint(flipped, model, opt)

    missing = str(tmp_path / "missing")
    shutil.copytree(path, missing)
    os.remove(os.path.join(missing, "index-rank00000.json"))
    with pytest.raises(CheckpointError, match=r"index of rank 0 is missing.*index-rank00000\.json"):
        load_checkpoint(missing, model, opt)

    no_shard = str(tmp_path / "no_shard")
    shutil.copytree(path, no_shard)
    os.remove(os.path.join(no_shard, "shards-rank00000.safetensors"))
    with pytest.raises(CheckpointError, match=r"checkpoint file is missing: .*shards-rank00000\.safetensors"):
        load_checkpoint(no_shard, model, opt)
    _assert_unchanged(model, opt, before)


def test_incomplete_checkpoint_and_wrong_optimizer_are_refused(trained, tmp_path):
    path, _, _ = trained
    model, opt = _fresh()
    partial = str(tmp_path / "partial")
    shutil.copytree(path, partial)
    os.remove(os.path.join(partial, "COMPLETE"))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(partial, model, opt)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        consolidate(partial, str(tmp_path / "out"))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"holds torch\.optim\.adamw\.AdamW state, the optimizer is "
                                              r"torch\.optim\.sgd\.SGD"):
        load_checkpoint(path, model, sgd)


def test_per_shard_optimizer_state_on_another_layout_needs_a_decision(tmp_path):
    """Adafactor's column factor is computed over each shard's rows: exact on the same layout only."""
    from transformers.optimization import Adafactor

    model, _ = cc.wrapped("mlp_nested", "sgd", {})
    opt = Adafactor(model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False)
    cc.train(model, opt, "mlp_nested", range(2), device=torch_xla.device(), sync=torch_xla.sync)
    path = str(tmp_path / "ada")
    save_checkpoint(path, model, opt, step=2)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    kinds = {k: v["kind"] for k, v in meta["optimizer"]["state"]["0.weight"].items()}
    assert kinds == {"step": "scalar", "exp_avg_sq_row": "rows", "exp_avg_sq_col": "per_rank", "RMS": "scalar"}
    # same layout: exact
    again, _ = cc.wrapped("mlp_nested", "sgd", {}, seed=4)
    opt2 = Adafactor(again.parameters(), lr=1e-2, scale_parameter=False, relative_step=False)
    load_checkpoint(path, again, opt2)
    a = cc.train(model, opt, "mlp_nested", range(2, 4), device=torch_xla.device(), sync=torch_xla.sync)
    b = cc.train(again, opt2, "mlp_nested", range(2, 4), device=torch_xla.device(), sync=torch_xla.sync)
    assert a == b
    # another layout (here: the plain model) must decide
    plain = pc.build_model("mlp_nested")
    opt3 = Adafactor(plain.parameters(), lr=1e-2, scale_parameter=False, relative_step=False)
    with pytest.raises(CheckpointError, match=r"exp_avg_sq_col.*per_rank_state='average'"):
        load_checkpoint(path, plain, opt3)
    load_checkpoint(path, plain, opt3, per_rank_state="average")
    assert opt3.state[plain[0].weight]["exp_avg_sq_col"].shape == (32,)


def test_a_save_that_cannot_complete_leaves_the_previous_checkpoint(trained, tmp_path):
    path, model, opt = trained
    # a file where the checkpoint's folder should go
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint .*blocked/ckpt"):
        save_checkpoint(str(blocked / "ckpt"), model, opt, step=3)
    # a full disk: the file-size limit makes the kernel refuse the write (EFBIG), in a child process
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch, torch_xla
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import checkpoint_cases as cc
        from xla_fsdp.checkpoint import save_checkpoint, CheckpointWriteError
        model, opt = cc.wrapped("gpt2", "adamw", {{}})
        cc.train(model, opt, "gpt2", range(1), device=torch_xla.device(), sync=torch_xla.sync)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            save_checkpoint({path!r}, model, opt, step=9)
        except CheckpointWriteError as e:
            print("REFUSED", e)
    """)
    before = sorted(os.listdir(path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert "REFUSED could not write checkpoint" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "File too large" in proc.stdout
    assert sorted(os.listdir(path)) == before and not os.path.exists(path + ".partial")
    model2, opt2 = _fresh()
    assert load_checkpoint(path, model2, opt2)["step"] == 2  # the previous checkpoint is intact


def test_virtual_host_settings_that_cannot_work_are_refused_by_name(tmp_path):
    """XLA_FSDP_VIRTUAL_HOSTS ([Note: virtual hosts]) that do not split the devices, a missing or
    out-of-range index, and virtual hosts without the SPMD runtime each name what to fix; nothing
    is written."""
    script = textwrap.dedent(f"""
        import os, torch, torch_xla, torch_xla.runtime as xr
        from xla_fsdp.runtime import hosts
        from xla_fsdp.checkpoint import save_checkpoint
        cases = [("2", "0", False), ("3", "0", True), ("2", "", True), ("2", "2", True)]
        for n, i, spmd in cases:
            os.environ["XLA_FSDP_VIRTUAL_HOSTS"], os.environ["XLA_FSDP_VIRTUAL_HOST_INDEX"] = n, i
            if spmd and not xr.is_spmd():
                xr.use_spmd()
            try:
                hosts.host_view()
            except (ValueError, RuntimeError) as e:
                print("REFUSED", n, i, e)
        model = torch.nn.Linear(4, 4).to(torch_xla.device())
        try:
            save_checkpoint({str(tmp_path / "ckpt")!r}, model)
        except (ValueError, RuntimeError) as e:
            print("REFUSED save", e)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4"))
    refusals = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 5, proc.stdout + proc.stderr[-3000:]
    assert "needs the SPMD runtime" in refusals[0]
    assert "does not divide the 4 devices" in refusals[1] and "CPU_NUM_DEVICES" in refusals[1]
    assert "must be integers" in refusals[2] and "0 <= index < N" in refusals[3]
    assert "0 <= index < N" in refusals[4]  # the save asks for the hosts first: nothing written
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(tmp_path / "ckpt.partial")
