"""bench/llama_tpu.py's helpers: the depth it compiles and how it gets the full model's step."""
import json
import os

import pytest

from bench_modules import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_8B = os.path.join(ROOT, "configs", "models", "llama3-8b.json")


def test_with_layers_changes_the_depth_only(tmp_path):
    llama = load("llama_tpu")
    assert llama.with_layers(LLAMA_8B, 32, str(tmp_path)) == LLAMA_8B  # full depth: the file itself
    with open(llama.with_layers(LLAMA_8B, 3, str(tmp_path))) as f:
        got = json.load(f)
    with open(LLAMA_8B) as f:
        want = json.load(f)
    assert got.pop("num_hidden_layers") == 3
    want.pop("num_hidden_layers")
    assert got == want
    with pytest.raises(SystemExit, match="has 32 decoder layers"):
        llama.with_layers(LLAMA_8B, 33, str(tmp_path))


def test_full_step_prefers_the_compiled_full_depth_and_otherwise_extrapolates():
    llama = load("llama_tpu")
    rows = [{"layers": 2, "projected_s": 0.5}, {"layers": 1, "projected_s": 0.3}, {"layers": 4, "projected_s": 1.0}]
    step, how = llama.full_step(rows, 32)
    assert step == pytest.approx(0.3 + 31 * 0.2) and "EXTRAPOLATED" in how and "1 and 2" in how
    rows.append({"layers": 32, "projected_s": 5.0})
    assert llama.full_step(rows, 32) == (5.0, "compiled at full depth (32 layers)")
    assert llama.full_step([{"layers": 1, "projected_s": None}], 32)[0] is None


def test_the_command_is_the_documented_llama_job(tmp_path):
    """The docs' command (docs/performance.md): run_clm with the Llama FSDP config, the kernel, batch and seq."""
    llama = load("llama_tpu")
    cmd = llama.command(LLAMA_8B, 4, 8192, "pallas", str(tmp_path))
    assert cmd[0].endswith("launch/run_clm.py")
    flags = {a: cmd[i + 1] for i, a in enumerate(cmd) if a.startswith("--") and i + 1 < len(cmd)
             and not cmd[i + 1].startswith("--")}
    assert flags["--fsdp_config"].endswith("configs/fsdp/llama_xla_fsdp.json")
    assert (flags["--per_device_train_batch_size"], flags["--block_size"], flags["--attn_implementation"]) == (
        "4", "8192", "pallas")
    assert "--do_train" in cmd
