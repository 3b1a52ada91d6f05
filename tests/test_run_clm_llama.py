"""run_clm trains LlamaForCausalLM (configs/models/llama*.json) as it trains GPT-2.

- Parity on XLA:CPU: the tiny Llama (GQA 4 query / 2 key-value heads, SwiGLU, untied head)
  sharded over 4 virtual devices under launch/xla_spawn.py (one process, the single
  controller) logs the unsharded run's losses and ends with its parameters, step for step.
  Default run: the collective engine with tiny_cpu_llama_scan.json (the shipped
  llama_xla_fsdp_scan.json's engine settings in fp32: one unit per LlamaDecoderLayer, checkpointed
  and scanned, collectives off the chain); under `pytest -m slow` the same engine with the shipped
  tiny_cpu_llama.json and --gradient_checkpointing, the GSPMD engine (tiny_cpu_llama_v2.json) and a
  bare `--fsdp "full_shard auto_wrap"`.
- The layer class: a bare auto_wrap and --gradient_checkpointing take the model's decoder
  layer (transformers' _no_split_modules); an fsdp_config naming GPT2Block for a Llama is an
  error naming LlamaDecoderLayer.
- FLOPs: Llama 3 8B at sequence 8192 counts MaxText's FLOPs per token.
- The tiny Llama's step compiles for v5e-8 with libtpu (the ahead-of-time check; `-m slow`: the
  default run compiles the same config for v5e-8 with the attention kernel,
  tests/test_run_clm_attention.py).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "run_clm.py")
SPAWN = os.path.join(ROOT, "launch", "xla_spawn.py")
MODELS = os.path.join(ROOT, "configs", "models")
FSDP = os.path.join(ROOT, "configs", "fsdp")
TINY = os.path.join(MODELS, "llama-tiny.json")
# 16 sequences of 32 tokens per step: the reference's one device, or 4 devices x 4
COMMON = ["--config_name", TINY, "--do_train", "--max_steps", "4", "--block_size", "32", "--logging_steps", "1",
          "--learning_rate", "3e-3", "--seed", "3"]


def _train(out, args, devices=1, dump=None):
    """run_clm as a user runs it (under xla_spawn at several devices); returns (metrics.json, weights)."""
    from safetensors.torch import load_file

    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT)
    for name in ("XLA_FSDP_ENGINE", "XLA_FSDP_RUNTIME", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(name, None)
    if dump is not None:  # the step programs as XLA compiles them
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=SyncTensorsGraph"
    launcher = [SPAWN, "--num_cores", str(devices)] if devices > 1 else []
    cmd = [sys.executable, *launcher, SCRIPT, "--output_dir", str(out), *COMMON, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("llama_ref"), ["--per_device_train_batch_size", "16"])


@pytest.mark.parametrize("engine,flags", [
    # -m slow: the Llama on the collectives engine through the launcher is the scanned case below (its
    # layers checkpointed, collectives off the chain); --gradient_checkpointing's layer choice:
    # test_bare_auto_wrap_and_checkpointing_take_the_decoder_layer
    pytest.param("collectives", ["--fsdp", "full_shard", "--fsdp_config", os.path.join(FSDP, "tiny_cpu_llama.json"),
                                 "--gradient_checkpointing"], marks=pytest.mark.slow),
    # the shipped llama_xla_fsdp_scan.json's engine settings in fp32: scanned, collectives off the chain
    ("collectives", ["--fsdp", "full_shard", "--fsdp_config", os.path.join(FSDP, "tiny_cpu_llama_scan.json")]),
    pytest.param("spmd", ["--fsdp", "full_shard", "--fsdp_config", os.path.join(FSDP, "tiny_cpu_llama_v2.json")],
                 marks=pytest.mark.slow),
    pytest.param("collectives", ["--fsdp", "full_shard auto_wrap"], marks=pytest.mark.slow),
], ids=["collectives", "collectives_scan", "gspmd", "bare_auto_wrap"])
def test_sharded_llama_matches_the_unsharded_run(tmp_path, unsharded, engine, flags):
    reference, ref_weights = unsharded
    scanned = "tiny_cpu_llama_scan.json" in " ".join(flags)
    report, weights = _train(tmp_path / "out", ["--per_device_train_batch_size", "4", *flags], devices=4,
                             dump=tmp_path / "dump" if scanned else None)
    if scanned:  # the decoder layers ran as While loops (forward and backward)
        programs = [f.read_text() for f in (tmp_path / "dump").glob("*before_optimizations.txt")]
        assert any(text.count(" while(") >= 2 for text in programs), len(programs)
    assert report["engine"] == engine and report["devices"] == 4 and report["runtime"] == "single_controller"
    assert report["global_batch"] == reference["global_batch"] == 16
    steps = [s for s, _ in report["losses"]]
    assert steps == [1, 2, 3, 4] == [s for s, _ in reference["losses"]]
    for (_, got), (_, want) in zip(report["losses"], reference["losses"]):
        assert got == pytest.approx(want, rel=1e-5), (report["losses"], reference["losses"])
    assert report["losses"][-1][1] < report["losses"][0][1] - 0.5  # it learns
    # the same state-dict keys as the unwrapped model (untied lm_head included), the same values
    assert sorted(weights) == sorted(ref_weights) and "lm_head.weight" in weights
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert report["params"] == reference["params"] == 574080


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.from_json_file(TINY))


def test_bare_auto_wrap_and_checkpointing_take_the_decoder_layer():
    from xla_fsdp.train import families
    from xla_fsdp.train.args import parse_args
    from xla_fsdp.train.model import engine_kwargs

    model = _tiny_llama()
    assert families.decoder_layer_classes(model) == ("LlamaDecoderLayer",)
    assert families.decoder_layers(model) == list(model.model.layers)
    args = parse_args(["--config_name", TINY, "--output_dir", "o", "--fsdp", "full_shard auto_wrap"])
    policy = engine_kwargs(args, None, families.decoder_layer_classes(model))["auto_wrap_policy"]
    wrapped = [m for m in model.modules() if policy(m, recurse=False, unwrapped_params=0)]
    assert wrapped == list(model.model.layers)


def test_other_model_types_are_refused_by_name(tmp_path):
    from xla_fsdp.train.model import load_config

    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"model_type": "bert", "vocab_size": 512}))
    with pytest.raises(SystemExit, match=r"bert\.json: model_type 'bert'.*\"gpt2\" or \"llama\""):
        load_config(str(path))


def test_llama3_8b_flops_per_token_are_maxtexts():
    # MaxText's published v6e-256 run (tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-256/README.md):
    # "seconds: 4.546, TFLOP/s/device: 417.397, Tokens/s/device: 7207.336" at 4 x 8192 tokens per chip,
    # so 417.397e12 * 4.546 / 32768 FLOPs per token.
    from xla_fsdp import metrics
    from xla_fsdp.train.model import load_config

    c = load_config(os.path.join(MODELS, "llama3-8b.json"))
    assert metrics.num_params(c) == 8_030_261_248
    assert metrics.matmul_params(c) == 8_030_261_248 - 128256 * 4096 - (2 * 32 + 1) * 4096
    per_token = metrics.flops_per_step(metrics.matmul_params(c), 1, n_layer=c.num_hidden_layers,
                                       n_embd=metrics.attention_width(c), seq_len=8192, include_attention=True)
    assert per_token == pytest.approx(417.397e12 * 4.546 / (4 * 8192), rel=2e-3)


# -m slow: the same shipped config on the same slice compiles in the default run with the attention kernel,
# tests/test_run_clm_attention.py::test_tiny_llama_with_the_shipped_config_compiles_with_head_major_projections
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the TPU compiler comes with `pip install -e .[tpu-aot]`")
def test_tiny_llama_step_compiles_for_v5e_8(tmp_path):
    cmd = [SCRIPT, "--config_name", TINY, "--fsdp", "full_shard", "--fsdp_config",
           os.path.join(FSDP, "llama_xla_fsdp.json"), "--output_dir", str(tmp_path / "out"), "--do_train",
           "--per_device_train_batch_size", "2", "--block_size", "64"]
    got = ac.check("v5e-8", cmd, timeout=600)
    assert got["rc"] == 0 and got["report"] and got["report"]["compiles"], got["output"]


def test_a_recomputation_policy_from_the_fsdp_config_trains_like_the_unsharded_run(tmp_path, unsharded):
    """run_clm launched as the README says, at 4 devices, with the shipped scanned Llama settings and
    `xla_fsdp_settings.remat_policy` ([Note: recomputation policies]): the losses of the unsharded run."""
    with open(os.path.join(FSDP, "tiny_cpu_llama_scan.json")) as f:
        cfg = json.load(f)
    cfg["xla_fsdp_settings"]["remat_policy"] = "minimal_offloaded"  # on XLA:CPU, "minimal" in device memory
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(cfg))
    reference, _ = unsharded
    report, _ = _train(tmp_path / "out", ["--per_device_train_batch_size", "4", "--fsdp", "full_shard",
                                          "--fsdp_config", str(path)], devices=4)
    for (_, got), (_, want) in zip(report["losses"], reference["losses"]):
        assert got == pytest.approx(want, rel=1e-5), (report["losses"], reference["losses"])
    assert len(report["losses"]) == 4
