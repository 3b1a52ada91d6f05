"""run_clm with `--attn_implementation pallas`: what it refuses (attention dropout, sequence lengths
the kernel cannot take, a CPU outside the ahead-of-time check), and the check compiling a tiny
GPT-2 step with the kernel for v5e-8, its attention a `tpu_custom_call` of per-device shape (every
GPT-2 variant under `-m slow`; the default run compiles the tiny Llama with the shipped config)."""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402

ROOT = ac.ROOT
TINY = os.path.join(ROOT, "configs", "models", "gpt2-tiny.json")
TWO_B = os.path.join(ROOT, "configs", "models", "gpt2-2b.json")
NEEDS_AOT = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jax") is None,
                               reason="libtpu / jax not installed: `pip install -e .[tpu-aot]`")


def _main(argv):
    from xla_fsdp.train.job import run

    return run(argv)


def test_attention_dropout_with_the_kernel_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(SystemExit, match=r"gpt2-2b.json sets attn_pdrop=0.1.*set attn_pdrop to 0.*gpt2-2b-nodropout"):
        _main(["--config_name", TWO_B, "--output_dir", str(tmp_path / "o"), "--attn_implementation", "pallas"])


def test_a_block_size_the_kernel_cannot_take_is_refused_before_the_runtime_starts(tmp_path):
    with pytest.raises(SystemExit, match=r"--block_size 64: the Pallas attention kernel .*multiple of 128"):
        _main(["--config_name", TINY, "--output_dir", str(tmp_path / "o"), "--attn_implementation", "pallas",
               "--block_size", "64"])


def test_the_kernel_on_cpu_outside_the_check_is_refused_naming_eager_and_the_check(tmp_path, monkeypatch):
    for name in ("XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "XLA_FSDP_AOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(SystemExit, match=r"needs a TPU; this runs on CPU.*attn_implementation eager.*xla_fsdp.aot"):
        _main(["--config_name", TINY, "--output_dir", str(tmp_path / "o"), "--attn_implementation", "pallas",
               "--max_steps", "1"])


@NEEDS_AOT
@pytest.mark.parametrize("case, runtime, kernels", [
    # checkpointed blocks: the kernel runs again, per device, in backward (2 layers x forward, its
    # recompute, dq, dkv). -m slow: the default run compiles the same for the tiny Llama with the
    # shipped config (checkpointed layers, 8 kernels of per-device shape, our head-major projections),
    # test_tiny_llama_with_the_shipped_config_compiles_with_head_major_projections below
    pytest.param("sc-grad_ckpt", "auto", 8, marks=pytest.mark.slow),
    # global tensors: the kernel gets the batch's partition spec (2 layers x forward, dq, dkv)
    pytest.param("gspmd", "auto", 6, marks=pytest.mark.slow),
    pytest.param("mp-grad_ckpt", "multi_process", 8, marks=pytest.mark.slow),
])
def test_tiny_gpt2_step_with_the_kernel_compiles_for_v5e_8_and_its_attention_is_a_tpu_custom_call(
        tmp_path, case, runtime, kernels):
    cmd = ac.command(ac.BY_NAME[case], 8, str(tmp_path / "fsdp.json"), str(tmp_path / "out"), block=128)
    got = ac.check("v5e-8", [*cmd, "--attn_implementation", "pallas"], runtime=runtime,
                   extra=["--dump", str(tmp_path / "dump")], timeout=300)
    assert got["rc"] == 0, got["output"]
    assert got["report"]["compiles"], got["output"]
    optimized = (tmp_path / "dump" / "tpu_optimized.hlo.txt").read_text()
    found = re.findall(r"= \(?(bf16\[[0-9,]+\])[^=]*custom-call\([^)]*\), custom_call_target=\"tpu_custom_call\"",
                       optimized)
    assert len(found) == kernels, found
    # each on one chip's batch of 2 (16 sequences over 8 chips), 4 heads of 32
    assert all(k.startswith("bf16[2,4,128,32]") for k in found), found
    assert got["report"]["projection"]["kernel_calls"] == kernels
    # [Note: head-major projections]: GPT-2's projections around the kernel are ours where the model
    # sees per-device tensors, transformers' own under the GSPMD partitioner
    traced = (tmp_path / "dump" / "traced_step.hlo.txt").read_text()
    assert ("gpt2_heads.py" in traced) == (case != "gspmd")


@NEEDS_AOT
def test_tiny_llama_with_the_shipped_config_compiles_with_head_major_projections(tmp_path):
    """The shipped Llama config (per-layer checkpointing, token_chain "off") on the tiny Llama for
    v5e-8 with the kernel: it compiles, the kernel runs per layer in the forward, its recompute and
    the backward's two, on grouped-query attention expanded to the 4 query heads, and the
    projections around it are ours ([Note: head-major Llama projections])."""
    cmd = [ac.RUN_CLM, "--config_name", os.path.join(ROOT, "configs", "models", "llama-tiny.json"), "--fsdp",
           "full_shard", "--fsdp_config", os.path.join(ROOT, "configs", "fsdp", "llama_xla_fsdp.json"),
           "--output_dir", str(tmp_path / "out"), "--do_train", "--per_device_train_batch_size", "2",
           "--block_size", "128", "--attn_implementation", "pallas"]
    got = ac.check("v5e-8", cmd, extra=["--dump", str(tmp_path / "dump")], timeout=300)
    assert got["rc"] == 0 and got["report"]["compiles"], got["output"]
    optimized = (tmp_path / "dump" / "tpu_optimized.hlo.txt").read_text()
    found = re.findall(r"= \(?(bf16\[[0-9,]+\])[^=]*custom-call\([^)]*\), custom_call_target=\"tpu_custom_call\"",
                       optimized)
    assert len(found) == 8 and all(k.startswith("bf16[2,4,128,32]") for k in found), found
    traced = (tmp_path / "dump" / "traced_step.hlo.txt").read_text()
    assert "llama_heads.py" in traced and "modeling_llama.py" in traced
