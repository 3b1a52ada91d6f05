"""Offline consolidation to Hugging Face, and torch_xla's per-rank checkpoint flow."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import checkpoint_cases as cc
import parity_cases as pc
from parity_cases import run_distributed_fn


def test_consolidated_checkpoint_loads_with_from_pretrained(tmp_path):
    """gloo world 2 trains GPT-2, saves sharded; the CLI consolidates it offline into a
    save_pretrained directory; GPT2LMHeadModel.from_pretrained computes the same logits."""
    from transformers import GPT2LMHeadModel

    run_distributed_fn(cc.export_worker, 2, str(tmp_path))
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", str(tmp_path / "ckpt"),
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert "transformer.wte.weight" in header and "lm_head.weight" not in header  # tied: stored once
    assert header["__metadata__"] == {"format": "pt"}
    model = GPT2LMHeadModel.from_pretrained(str(out))
    assert model.lm_head.weight is model.transformer.wte.weight
    x, _ = pc.batch("gpt2", 7)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    torch.testing.assert_close(logits, torch.load(tmp_path / "logits.pt"), rtol=1e-5, atol=1e-5)


def test_consolidation_of_a_partial_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", str(tmp_path / "ckpt"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "is not a complete checkpoint" in proc.stderr


SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "fsdpv1_style_train.py")
TORCH_XLA_IMPORT = ("from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP, "
                    "consolidate_sharded_model_checkpoints  # IMPORT")
XLA_FSDP_IMPORT = "from xla_fsdp import XlaFullyShardedDataParallel as FSDP, consolidate_sharded_model_checkpoints"


def _script(tmp_path, ours: bool) -> str:
    text = open(SCRIPT).read()
    assert text.count(TORCH_XLA_IMPORT) == 1
    if ours:
        text = text.replace(TORCH_XLA_IMPORT, XLA_FSDP_IMPORT)
    path = tmp_path / ("script_ours.py" if ours else "script_control.py")  # never a package name
    path.write_text(text)
    return str(path)


def _run_script(script, out, *extra, env_extra=None):
    env = dict(os.environ, PJRT_DEVICE="CPU", **(env_extra or {}))
    return subprocess.Popen([sys.executable, script, str(out), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _check(out):
    result = torch.load(out / "result.pt", weights_only=False)
    torch.testing.assert_close(result["consolidated"], result["sharded"], rtol=1e-5, atol=1e-5)
    assert result["path"] == str(out / "final_ckpt") + "_consolidated.pth" and os.path.isfile(result["path"])
    assert result["accuracy"] > 0.3  # it learned something: chance is 0.1
    return result


@pytest.mark.parametrize("engine", ["xla_fsdp", "torch_xla"])
def test_torch_xla_style_script_at_xla_world_1(tmp_path, engine):
    """The same script, only the import changed; torch_xla's own FSDP runs it as the control."""
    out = tmp_path / f"out-{engine}"  # not "xla_fsdp": the script's folder comes first on sys.path
    out.mkdir()
    proc = _run_script(_script(tmp_path, engine == "xla_fsdp"), out)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    _check(out)


def test_torch_xla_style_script_at_gloo_world_2(tmp_path):
    out = tmp_path / "gloo"
    out.mkdir()
    script = _script(tmp_path, True)
    store = str(tmp_path / "store")
    procs = [_run_script(script, out, "--gloo", str(r), "2", store) for r in range(2)]
    for p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, log[-4000:]
    _check(out)
    files = sorted(f for f in os.listdir(out) if f.startswith("final_ckpt_rank-"))
    assert files == ["final_ckpt_rank-00000000-of-00000002.pth", "final_ckpt_rank-00000001-of-00000002.pth"]


def test_consolidation_names_missing_and_foreign_rank_files(tmp_path):
    from xla_fsdp import consolidate_sharded_model_checkpoints
    from xla_fsdp.checkpoint import CheckpointError

    meta = {"format": "xla_fsdp.shard_metadata/1", "world_size": 3, "rank": 0, "shard_groups": [[0, 1, 2]],
            "shard_info": {"w": {"shape": [5], "rows": 5, "rows_per_rank": 2, "tied_to": None}}, "buffer_info": {}}
    for rank in (0, 2):
        torch.save({"model": {"w": torch.ones(2)}, "shard_metadata": dict(meta, rank=rank)},
                   tmp_path / f"c_rank-{rank:08d}-of-00000003.pth")
    with pytest.raises(CheckpointError, match=r"ranks 0..2, found ranks \[0, 2\] \(missing \[1\]\)"):
        consolidate_sharded_model_checkpoints(str(tmp_path / "c"), "_rank-*-of-*.pth")
    torch.save({"model": {}, "shard_metadata": {"world_size": 1, "rank": 0}}, tmp_path / "t_rank-0.pth")
    with pytest.raises(CheckpointError, match="is not a per-rank FSDP checkpoint"):
        consolidate_sharded_model_checkpoints(str(tmp_path / "t"), "_rank-*.pth")


def _mixed_layout_worker(rank, world, tmp_dir):
    from xla_fsdp.checkpoint import full_state_dict

    for case in pc.MIXED_LAYOUTS:
        model = pc.wrap(case, pc.build_model(case.model))
        opt = pc.make_optimizer(case.optim, model.parameters())
        for step in range(2):
            x, y = pc.batch(case.model, step)
            pc.loss_fn(case.model, model, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]).backward()
            model.clip_grad_norm_(case.clip)
            opt.step()
            opt.zero_grad()
        full = full_state_dict(model, rank0_only=False)
        torch.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(), "full": full},
                   os.path.join(tmp_dir, f"{case.name}_rank{rank}.pt"))


def test_torch_xla_flow_consolidates_nested_units_of_different_layouts(tmp_path):
    """torch_xla's per-rank flow with a NO_SHARD unit in a FULL_SHARD root and the reverse (gloo
    world 2): each parameter is rebuilt from the ranks of the unit that holds it. With the root's
    group for every parameter, a FULL_SHARD unit in a NO_SHARD root came back half."""
    from xla_fsdp.checkpoint import consolidate_sharded_state_dicts

    run_distributed_fn(_mixed_layout_worker, 2, str(tmp_path))
    for case in pc.MIXED_LAYOUTS:
        saved = [torch.load(tmp_path / f"{case.name}_rank{r}.pt", weights_only=False) for r in range(2)]
        full = consolidate_sharded_state_dicts([s["model"] for s in saved], saved[0]["shard_metadata"])
        want = saved[0]["full"]
        assert set(full) == set(want), case.name
        for name, value in want.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=f"{case.name} {name}")


# [torch_xla's FSDP and ours, both flag values, both consolidations] At XLA world 1 (more than one
# XLA:CPU device hangs on explicit collectives) each library trains the same nested model a few steps
# and saves its rank file the torch_xla way; both libraries' consolidate_sharded_model_checkpoints read
# torch_xla's files and must agree exactly. torch_xla's function cannot read ours (their keys are the
# unwrapped model's) and must fail rather than return shards as weights.

def _nested_model():
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    model.register_buffer("count", torch.arange(3.0))
    return model


def _wrap_linears(module, recurse, *args, **kwargs):  # both libraries' auto_wrap_policy call shapes
    import torch.nn as nn

    return recurse or isinstance(module, nn.Linear)


def _train_and_save(fsdp_class, prefix, **kwargs):
    """A few SGD steps at XLA world 1, then the rank file; returns the wrapped model."""
    import torch_xla

    device = torch_xla.device()
    model = fsdp_class(_nested_model().to(device), auto_wrap_policy=_wrap_linears, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 5, generator=gen).to(device)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    torch.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()},
               f"{prefix}_rank-00000000-of-00000001.pth")
    return model


def _reshard_torch_xla_file(src, prefix, world, shard_param_on_dim_0):
    """torch_xla's world-1 rank file as `world` rank files in torch_xla's layout for the flag (1-D
    slices of the flattened parameter padded to world x 128, or dim-0 rows padded to the world size):
    what its FSDP would save at that world, which XLA:CPU cannot run."""
    ckpt = torch.load(src, weights_only=False)
    meta = ckpt["shard_metadata"]
    ranks = [{} for _ in range(world)]
    for key, value in ckpt["model"].items():
        prefix_, _, name = key.rpartition(".")
        size = meta["shard_info"].get(prefix_, {}).get(name, {}).get("_orig_size")
        if size is None:  # a buffer: every rank holds it whole
            pieces = [value] * world
        elif value.dim() == 1 and not (shard_param_on_dim_0 and len(size) == 1):
            flat = value[:size.numel()]
            flat = torch.nn.functional.pad(flat, [0, -flat.numel() % (world * 128)])
            pieces = flat.chunk(world)
        else:
            rows = torch.nn.functional.pad(value, [0, 0] * (value.dim() - 1) + [0, -value.shape[0] % world])
            pieces = rows.chunk(world)
        for rank, piece in enumerate(pieces):
            ranks[rank][key] = piece.clone()
    for rank, state in enumerate(ranks):
        torch.save({"model": state, "shard_metadata": dict(meta, world_size=world, rank=rank)},
                   f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth")


def _assert_same(got, want, atol=0.0, ordered=True):
    assert list(got) == list(want) if ordered else set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=name)


def _both_consolidations(prefix, capsys):
    """(ours, torch_xla's) consolidated state dicts of `prefix`'s files, and each one's printed lines."""
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints as theirs

    from xla_fsdp import consolidate_sharded_model_checkpoints as ours

    capsys.readouterr()
    mine, mine_path = ours(prefix, "_rank-*-of-*.pth", save_path=prefix + "_ours.pth")
    mine_log = capsys.readouterr().out.splitlines()
    want, want_path = theirs(prefix, "_rank-*-of-*.pth", save_path=prefix + "_theirs.pth")
    want_log = capsys.readouterr().out.splitlines()
    assert mine_path == prefix + "_ours.pth" and torch.load(mine_path)["model"].keys() == mine.keys()
    assert mine_log == [line.replace(want_path, mine_path) for line in want_log]  # torch_xla's two lines
    return mine, want


def _consolidation_parity(tmp_path, capsys, shard_param_on_dim_0, flatten_parameters, worlds):
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as TorchXlaFSDP
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints as theirs

    from xla_fsdp import XlaFullyShardedDataParallel, consolidate_sharded_model_checkpoints
    from xla_fsdp.checkpoint import full_state_dict

    kw = dict(shard_param_on_dim_0=shard_param_on_dim_0, flatten_parameters=flatten_parameters)
    _train_and_save(TorchXlaFSDP, str(tmp_path / "txla"), **kw)
    mine, want = _both_consolidations(str(tmp_path / "txla"), capsys)
    _assert_same(mine, want)
    for world in worlds:
        prefix = str(tmp_path / f"txla_w{world}")
        _reshard_torch_xla_file(tmp_path / "txla_rank-00000000-of-00000001.pth", prefix, world, shard_param_on_dim_0)
        mine_w, want_w = _both_consolidations(prefix, capsys)
        _assert_same(mine_w, want_w)
        _assert_same(mine_w, want)

    model = _train_and_save(XlaFullyShardedDataParallel, str(tmp_path / "ours"), **kw)
    assert [tuple(p.shape) for p in model.parameters()] == [(7, 5), (7,), (7,), (7,), (3, 7), (3,)]  # dim 0
    ours, _ = consolidate_sharded_model_checkpoints(str(tmp_path / "ours"), "_rank-*-of-*.pth", save_model=False)
    _assert_same(ours, full_state_dict(model, rank0_only=False), ordered=False)
    _assert_same(ours, want, atol=1e-6, ordered=False)  # the same training in two programs: not bitwise
    with pytest.raises(KeyError, match="flatten_info"):  # never shards passed off as weights
        theirs(str(tmp_path / "ours"), "_rank-*-of-*.pth", save_model=False)


@pytest.mark.parametrize("shard_param_on_dim_0", [False, True])
def test_consolidation_matches_torch_xla_for_both_libraries_files(tmp_path, capsys, shard_param_on_dim_0):
    pytest.importorskip("torch_xla")
    _consolidation_parity(tmp_path, capsys, shard_param_on_dim_0, flatten_parameters=False, worlds=(2,))


@pytest.mark.slow
@pytest.mark.parametrize("shard_param_on_dim_0", [False, True])
@pytest.mark.parametrize("flatten_parameters", [False, True])
def test_consolidation_matches_torch_xla_matrix(tmp_path, capsys, shard_param_on_dim_0, flatten_parameters):
    pytest.importorskip("torch_xla")
    _consolidation_parity(tmp_path, capsys, shard_param_on_dim_0, flatten_parameters, worlds=(2, 3, 5))


def test_consolidation_prints_the_file_count_and_the_save_path(tmp_path, capsys):
    from xla_fsdp import consolidate_sharded_model_checkpoints

    meta = {"format": "xla_fsdp.shard_metadata/1", "world_size": 2, "rank": 0, "shard_groups": [[0, 1]],
            "shard_info": {"w": {"shape": [3], "rows": 3, "rows_per_rank": 2, "tied_to": None}}, "buffer_info": {}}
    for rank in range(2):
        torch.save({"model": {"w": torch.ones(2)}, "shard_metadata": dict(meta, rank=rank)},
                   tmp_path / f"c_rank-{rank:08d}-of-00000002.pth")
    prefix = str(tmp_path / "c")
    consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pth")
    assert capsys.readouterr().out.splitlines() == [f"found 2 checkpoint files in {prefix}_rank-*-of-*.pth",
                                                    f"saved consolidated model to {prefix}_consolidated.pth"]
    consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pth", save_model=False)
    assert capsys.readouterr().out.splitlines() == [f"found 2 checkpoint files in {prefix}_rank-*-of-*.pth"]
