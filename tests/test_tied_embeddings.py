"""A model moved to the XLA device before wrapping lost its tied embeddings there ([Note: ties lost
on the way to the device] in xla_fsdp/deferred/tied_embeddings.py): the wrapper re-ties them, and training
matches the tied model unsharded; weights trained apart are refused."""
import warnings

import pytest
import torch

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.unit_state import is_unit
from parity_cases import batch, gpt2_config, loss_fn, unpad

torch_xla = pytest.importorskip("torch_xla")


def _moved():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config()).to(torch_xla.device())
    assert model.transformer.wte.weight is not model.lm_head.weight  # what torch_xla's .to() does
    return model


def _train(model, steps: int = 3):
    dev = torch_xla.device()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = batch("gpt2", step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn("gpt2", model, x.to(dev), y.to(dev))
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def test_embeddings_untied_by_to_are_tied_again_and_train_as_the_tied_model():
    ref = _moved()
    ref.tie_weights()  # what transformers' Trainer does after .to(): the model its config describes
    ref_losses = _train(ref)

    model = _moved()
    with pytest.warns(UserWarning, match=r"untied by Module.to\(\) on torch_xla"):
        FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    assert model.transformer.wte.weight is model.lm_head.weight
    losses = _train(model)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    want = dict(ref.named_parameters())
    got = dict(model.named_parameters())  # world size 1: each shard is the whole (dim-0 padded) parameter
    assert sorted(got) == sorted(want)
    for name, p in got.items():
        torch.testing.assert_close(unpad(p.detach().cpu(), want[name]), want[name].detach().cpu(),
                                   rtol=1e-5, atol=1e-6, msg=name)


def test_untied_embeddings_train_differently():
    # what the re-tie prevents: the same model trained untied leaves the tied model's losses
    tied = _moved()
    tied.tie_weights()
    assert abs(_train(_moved())[-1] - _train(tied)[-1]) > 1e-3


def test_embeddings_trained_apart_are_refused_and_the_model_left_unwrapped():
    model = _moved()
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"tie_word_embeddings=True.*different values.*model.tie_weights\(\)"):
            FSDP(model)
    assert not is_unit(model) and not isinstance(model, FSDP)
    assert model.transformer.wte.weight is not model.lm_head.weight


def test_a_model_wrapped_on_the_cpu_keeps_its_tie_without_a_warning():
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        FSDP(model)
    assert model.transformer.wte.weight is model.lm_head.weight
