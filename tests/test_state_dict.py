"""Checkpoints: full state dicts equal the unsharded model's, sharded ones resume
exactly on the same layout, and a checkpoint from another layout is refused
before anything is written."""
import os

import pytest
import torch

import state_dict_cases as cases
from parity_cases import assert_rel_close, batch, build_model, loss_fn, run_distributed_fn


def _reference(steps):
    model = build_model("gpt2")
    opt = cases.stateless_sgd(model.parameters())
    for step in range(steps):
        x, y = batch("gpt2", step)
        loss_fn("gpt2", model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ckpt"))
    run_distributed_fn(cases.save, 2, out)
    run_distributed_fn(cases.resume, 2, out, 2)  # sharded, same layout
    run_distributed_fn(cases.resume, 4, out, 2)  # full, resharded onto 4 ranks
    return out


def test_full_state_dict_is_the_unwrapped_models(saved):
    full = torch.load(os.path.join(saved, "full.pt"))
    ref = _reference(2)
    assert list(full) == list(ref)  # same keys, same order, tied head included
    for name in ref:
        assert full[name].shape == ref[name].shape, name
        assert_rel_close(full[name], ref[name], 1e-5, name)
    assert full["lm_head.weight"] is full["transformer.wte.weight"]


@pytest.mark.parametrize("resumed", ["resumed_from2_on2.pt", "resumed_from2_on4.pt"])
def test_resume_continues_training_exactly(saved, resumed):
    got = torch.load(os.path.join(saved, resumed))
    ref = _reference(3)
    for name in ref:
        assert_rel_close(got[name], ref[name], 1e-5, f"{resumed} {name}")


def test_full_state_dict_loads_into_plain_model(saved):
    model = build_model("gpt2", seed=7)
    model.load_state_dict(torch.load(os.path.join(saved, "full.pt")))
    ref = _reference(2)
    assert_rel_close(model.transformer.h[1].mlp.c_fc.weight.detach(), ref["transformer.h.1.mlp.c_fc.weight"],
                     1e-5, "c_fc")


def _wrapped_xla():
    pytest.importorskip("torch_xla")
    from parity_cases import Case, wrap

    return wrap(Case("x", "gpt2"), build_model("gpt2", seed=5))


def _snapshot(model):
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def test_sharded_checkpoint_from_another_layout_is_refused(saved):
    from xla_fsdp.state_dict import load_sharded_state_dict

    model = _wrapped_xla()  # world size 1
    before = _snapshot(model)
    state = torch.load(os.path.join(saved, "sharded2.rank0.pt"))
    with pytest.raises(ValueError, match=r"another layout: it was saved with world_size=2, this model has "
                                         r"world_size=1.*load_full_state_dict"):
        load_sharded_state_dict(model, state)
    with pytest.raises(ValueError, match=r"not an xla_fsdp sharded checkpoint"):
        load_sharded_state_dict(model, torch.load(os.path.join(saved, "full.pt")))
    after = _snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_bad_full_state_dict_is_refused_before_writing(saved):
    from xla_fsdp.state_dict import load_full_state_dict

    model = _wrapped_xla()
    before = _snapshot(model)
    full = torch.load(os.path.join(saved, "full.pt"))
    renamed = dict(full)
    renamed["transformer.h.0.mlp.c_fc.weights"] = renamed.pop("transformer.h.0.mlp.c_fc.weight")
    with pytest.raises(ValueError, match=r"missing \['transformer.h.0.mlp.c_fc.weight'\]; unexpected "
                                         r"\['transformer.h.0.mlp.c_fc.weights'\]. Nothing was loaded"):
        load_full_state_dict(model, renamed)
    resized = dict(full)
    resized["transformer.h.1.attn.c_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"'transformer.h.1.attn.c_proj.weight' has shape \(64, 32\), the model "
                                         r"expects \(64, 64\)"):
        load_full_state_dict(model, resized)
    after = _snapshot(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # and the good one loads (world size 1: the shard is the whole parameter)
    load_full_state_dict(model, full)
    assert torch.equal(model.transformer.h[0].mlp.c_fc.weight.detach().cpu(), full["transformer.h.0.mlp.c_fc.weight"])
