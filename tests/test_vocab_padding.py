"""pad_vocabulary ([Note: padded vocabulary]): logits padded with -inf columns to a round
width give exactly the unpadded model's loss and gradients, on the host and sharded by the
GSPMD engine on virtual CPU devices."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xla_fsdp.vocab_padding import pad_vocabulary, padded_size

ROOT = Path(__file__).resolve().parents[1]


def _gpt2(vocab=500):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=vocab, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _loss_and_grads(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_padded_logits_give_the_same_loss_and_gradients():
    ids = torch.randint(0, 500, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    plain, padded = _gpt2(), _gpt2()
    assert pad_vocabulary(padded, 128) == 512
    a, ga = _loss_and_grads(plain, ids, labels)
    b, gb = _loss_and_grads(padded, ids, labels)
    assert b.logits.shape[-1] == 512 and torch.isneginf(b.logits[..., 500:]).all()
    assert torch.equal(b.logits[..., :500], a.logits)
    assert abs(a.loss.item() - b.loss.item()) <= 1e-6 * abs(a.loss.item())
    worst = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
    assert worst <= 1e-6, worst
    assert set(padded.state_dict()) == set(plain.state_dict())
    assert padded.lm_head.weight.shape[0] == 500  # the parameters keep the model's vocabulary


def test_a_round_vocabulary_is_left_alone_and_misuse_is_refused():
    model = _gpt2(vocab=512)
    assert pad_vocabulary(model, 128) == 512
    assert model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.shape[-1] == 512
    with pytest.raises(ValueError, match="call pad_vocabulary once"):
        pad_vocabulary(model, 128)
    with pytest.raises(TypeError, match="nn.Linear"):
        pad_vocabulary(torch.nn.Sequential(torch.nn.Linear(2, 2)), 128)
    with pytest.raises(ValueError, match="positive multiple"):
        padded_size(500, 0)


CASE = """
import json, sys, torch, torch_xla, torch_xla.runtime as xr
xr.use_spmd()
import functools, xla_fsdp
from transformers import GPT2Config, GPT2LMHeadModel
from xla_fsdp.wrap import transformer_auto_wrap_policy
from xla_fsdp.vocab_padding import pad_vocabulary

def run(pad):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=500, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if pad:
        pad_vocabulary(model, 128)
    model = xla_fsdp.XlaFullyShardedDataParallel(model, engine="spmd", compute_dtype=torch.bfloat16,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={"GPT2Block"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 500, (8, 16), generator=gen).to(torch_xla.device())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(); torch_xla.sync()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}

a, sa = run(False)
b, sb = run(True)
print("RESULT " + json.dumps({"plain": a, "padded": b,
      "param_diff": max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)}))
"""


def test_sharded_bf16_run_with_padded_logits_matches_at_4_devices():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    got = subprocess.run([sys.executable, "-c", CASE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [l for l in got.stdout.splitlines() if l.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    for a, b in zip(r["plain"], r["padded"]):
        assert abs(a - b) <= 1e-5 * abs(a), r
    assert r["param_diff"] <= 1e-5, r
