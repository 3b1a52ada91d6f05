"""The fused output loss ([Note: fused output loss], xla_fsdp/loss/) against transformers' own.

- On the host (eager torch): the loss and every parameter's gradient equal transformers'
  `ForCausalLMLoss` path for GPT-2 (tied head) and Llama (untied), with ignored labels, any
  chunk size, `num_items_in_batch` and a head bias; under bf16 autocast it stays as close to
  transformers' bf16 head as two bf16 programs can.
- On XLA:CPU through run_clm: 4 devices of the single controller with `--fused_loss` against
  transformers' head and loss (the default) at one device: the same losses and weights step for step.
- What it cannot do is refused by name.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from xla_fsdp.loss import fused_linear_cross_entropy, use_fused_loss
from xla_fsdp.loss.fused_cross_entropy import chunk_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=64,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2_tied", "llama_untied"])
def test_loss_and_gradients_equal_transformers(build):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 90, (3, 17))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored targets (a prompt, padding) leave the mean
    labels[2, 9] = -100
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    fused = use_fused_loss(copy.deepcopy(model))
    assert type(fused).__name__ == type(model).__name__  # save_pretrained's architectures unchanged
    out = fused(input_ids=ids, labels=labels)
    assert out.logits is None  # a training forward has no whole logits to read
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-6)
    want_g, got_g = _grads(ref), _grads(fused)
    assert sorted(want_g) == sorted(got_g)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # without labels: the model's own forward, logits and all
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("chunk", [1, 5, 51, 10_000])
def test_any_chunk_size_gives_the_same_loss_and_gradients(chunk):
    torch.manual_seed(1)
    hidden = torch.randn(3, 17, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    labels = torch.randint(0, 40, (3, 17))
    labels[1, 3:7] = -100
    from transformers.loss.loss_utils import ForCausalLMLoss
    want = ForCausalLMLoss(hidden @ weight.t() + bias, labels, vocab_size=40, num_items_in_batch=torch.tensor(23))
    want_g = torch.autograd.grad(want * 3.0, (hidden, weight, bias))
    got = fused_linear_cross_entropy(hidden, weight, labels, bias=bias, num_items_in_batch=torch.tensor(23),
                                     chunk=chunk)
    got_g = torch.autograd.grad(got * 3.0, (hidden, weight, bias))  # the incoming gradient scales them
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for w, g in zip(want_g, got_g):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_matches_the_bf16_head():
    torch.manual_seed(2)
    model = _gpt2()
    ids = torch.randint(0, 90, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = copy.deepcopy(model)(input_ids=ids, labels=ids).loss
        got = use_fused_loss(copy.deepcopy(model))(input_ids=ids, labels=ids).loss
    # both compute the head in bf16 and the loss in f32; they differ in where bf16 rounds
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=2e-3)


def test_chunk_size_bounds_the_logits():
    assert chunk_tokens(50257) == 2670  # 2B GPT-2: 2,670 x 50,257 x 4 bytes <= 512 MiB
    assert chunk_tokens(50257) * 50257 * 4 <= 512 << 20 < (chunk_tokens(50257) + 1) * 50257 * 4
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_tokens(10, chunk_bytes=0)


def test_what_it_cannot_do_is_refused_by_name():
    model = use_fused_loss(_gpt2())
    ids = torch.randint(0, 90, (2, 8))
    with pytest.raises(ValueError, match="shift_labels"):
        model(input_ids=ids, labels=ids, shift_labels=ids)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=ids, logits_to_keep=1)
    with pytest.raises(TypeError, match="keyword arguments"):
        model(ids, labels=ids)
    with pytest.raises(ValueError, match=r"labels \(2, 7\)"):
        fused_linear_cross_entropy(torch.randn(2, 8, 4), torch.randn(10, 4), ids[:, :7])
    with pytest.raises(ValueError, match="hidden size 4"):
        fused_linear_cross_entropy(torch.randn(2, 8, 4), torch.randn(10, 5), ids)
    with pytest.raises(TypeError, match="causal LM"):
        use_fused_loss(torch.nn.Linear(3, 3))


def _run_clm(out, args, devices):
    from safetensors.torch import load_file

    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT)
    for name in ("XLA_FSDP_ENGINE", "XLA_FSDP_RUNTIME", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(name, None)
    launcher = [os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", str(devices)] if devices > 1 else []
    cmd = [sys.executable, *launcher, os.path.join(ROOT, "launch", "run_clm.py"), "--output_dir", str(out),
           "--config_name", os.path.join(ROOT, "configs", "models", "gpt2-tiny.json"), "--do_train",
           "--max_steps", "4", "--block_size", "32", "--logging_steps", "1", "--learning_rate", "3e-3",
           "--seed", "5", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), load_file(str(out / "model.safetensors"))


def test_sharded_fused_run_matches_transformers_loss_on_one_device(tmp_path):
    # XLA:CPU: the fused loss sharded over 4 devices of the single controller, per-layer
    # checkpointing, against transformers' head and loss (the default) on one device, same data and init
    want, want_w = _run_clm(tmp_path / "ref", ["--per_device_train_batch_size", "16"], 1)
    got, got_w = _run_clm(tmp_path / "fused", ["--fused_loss",
        "--per_device_train_batch_size", "4", "--fsdp", "full_shard",
        "--fsdp_config", os.path.join(ROOT, "configs", "fsdp", "tiny_cpu.json"), "--gradient_checkpointing"], 4)
    assert got["devices"] == 4 and got["runtime"] == "single_controller"
    assert [s for s, _ in got["losses"]] == [s for s, _ in want["losses"]] == [1, 2, 3, 4]
    for (_, g), (_, w) in zip(got["losses"], want["losses"]):
        assert g == pytest.approx(w, rel=1e-5), (got["losses"], want["losses"])
    assert sorted(got_w) == sorted(want_w)
    for name, value in want_w.items():
        torch.testing.assert_close(got_w[name], value, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_each_chunk_waits_for_the_previous_ones_sums():
    """[Note: one chunk at a time]: on XLA the traced loss holds one optimization barrier between each two chunks."""
    import torch_xla

    device = torch_xla.device()
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 16).to(device), torch.randn(128, 16).to(device)
    loss = fused_linear_cross_entropy(hidden, weight, torch.randint(0, 128, (64,)).to(device), chunk=16)
    assert torch_xla._XLAC._get_xla_tensors_hlo([loss]).count(" opt-barrier(") == 64 // 16 - 1


@pytest.mark.slow
def test_the_chunks_run_one_at_a_time_on_a_tpu():
    """[Note: one chunk at a time]: compiled by libtpu for v4-8, the fused loss's 8 chunks of a 32,768-word vocabulary
    hold at most a few chunks' weight gradients (64 MiB each in f32) at the step's peak, not all 8 (214 MiB in all with
    the barrier, 536 MiB without it, 2026-12-07)."""
    from common import aot_cases as ac

    got = ac.check("v4-8", [os.path.join(ROOT, "tests", "fixtures", "aot_fused_loss_chunks.py")], runtime="multi_process",
                   extra=["--quiet"], timeout=600)
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"]
    chunk_grad = 32768 * 512 * 4
    assert report["compiles"] and report["memory"]["peak"] < 5 * chunk_grad, report["memory"]
