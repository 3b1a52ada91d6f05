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
    with pytest.raises(CheckpointError, match="is not a per-rank xla_fsdp checkpoint"):
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
