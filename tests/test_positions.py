"""[Note: position embeddings as a slice] (xla_fsdp/train/positions.py): GPT-2's position lookup
in training reads the table's first T rows as a slice, with transformers' values and gradients,
and only where transformers would look up 0..T-1."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")

from xla_fsdp.train.positions import use_sliced_positions  # noqa: E402


class CountEmbeddings(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.embedding:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _models():
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    sliced = copy.deepcopy(plain)
    assert use_sliced_positions(sliced) == 1
    assert use_sliced_positions(sliced) == 0  # once
    return plain, sliced


def _step(model, ids, **kwargs):
    model.zero_grad()
    with CountEmbeddings() as count:
        out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, count.calls


def test_the_training_call_slices_and_matches_transformers():
    plain, sliced = _models()
    ids = torch.randint(0, 64, (3, 11))
    loss_a, grads_a, calls_a = _step(plain, ids)
    loss_b, grads_b, calls_b = _step(sliced, ids)
    assert (calls_a, calls_b) == (2, 1)  # tokens and positions; tokens only
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-6, atol=1e-7, msg=name)
    # rows past T get no gradient, as from the lookup
    assert grads_b["transformer.wpe.weight"][11:].abs().max() == 0


def test_explicit_positions_and_a_cache_run_the_lookup():
    plain, sliced = _models()
    ids = torch.randint(0, 64, (2, 6))
    shifted = torch.arange(3, 9).unsqueeze(0).expand(2, -1)
    a, _, calls_a = _step(plain, ids, position_ids=shifted)
    b, _, calls_b = _step(sliced, ids, position_ids=shifted)
    assert calls_b == 2 and torch.allclose(a, b)
    with torch.no_grad():  # generation: the second call reads positions after the cache's
        past = sliced(input_ids=ids[:, :4], use_cache=True).past_key_values
        with CountEmbeddings() as count:
            got = sliced(input_ids=ids[:, 4:], past_key_values=past).logits
        assert count.calls == 2
        want = plain(input_ids=ids).logits[:, 4:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_forward_that_raises_leaves_the_table_looking_up_positions():
    """The slice is only for the call in flight: a GPT2Model forward that fails part-way (here a
    sequence longer than the table) leaves the embedding back on transformers' lookup."""
    _, sliced = _models()
    with pytest.raises(Exception):
        sliced(torch.zeros(1, 40, dtype=torch.long))
    wpe = sliced.transformer.wpe
    assert not getattr(wpe, "_xla_fsdp_positions_in_order")
    with CountEmbeddings() as count:
        wpe(torch.arange(4)[None])
    assert count.calls == 1  # the gather, not the slice
