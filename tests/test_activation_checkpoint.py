"""Per-layer gradient checkpointing: identical gradients, recomputation visible
in the XLA graph, fewer bytes kept for backward; with nested units and bf16."""
import pytest
import torch

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.memory.saved_activations import saved_activation_bytes
from parity_cases import batch, build_model, loss_fn

torch_xla = pytest.importorskip("torch_xla")


def _wrapped_gpt2(checkpoint: bool, dtype=None, **extra):
    model = build_model("gpt2")
    kwargs = {"auto_wrap_policy": xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
              "activation_checkpointing": checkpoint, **extra}
    if dtype is not None:
        kwargs["compute_dtype"] = dtype
    return FSDP(model, **kwargs)


def _grads_and_hlo(checkpoint: bool, dtype=None, **extra):
    model = _wrapped_gpt2(checkpoint, dtype, **extra)
    x, y = batch("gpt2", 0)
    dev = torch_xla.device()
    loss_fn("gpt2", model, x.to(dev), y.to(dev)).backward()
    grads = [p.grad for _, p in model.named_parameters()]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    torch_xla.sync()
    return {n: p.grad.cpu() for n, p in model.named_parameters()}, hlo


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_gradients_and_recompute_in_hlo(dtype):
    plain, plain_hlo = _grads_and_hlo(False, dtype)
    ckpt, ckpt_hlo = _grads_and_hlo(True, dtype)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    # each block's forward has 6 dots (4 projections, 2 in attention); backward needs all
    # recomputed ones but the last projection's output, so 5 per block appear again
    assert ckpt_hlo.count(" dot(") == plain_hlo.count(" dot(") + 2 * 5
    # the recomputation starts behind an optimization barrier (one per checkpointed unit)
    assert ckpt_hlo.count("opt-barrier(") >= plain_hlo.count("opt-barrier(") + 2


def test_checkpoint_all_but_last_recomputes_only_the_earlier_blocks():
    """checkpoint_all_but_last=1 ([Note: checkpoint all but the last]): the same gradients, and
    the last block's forward is not run again in backward (5 recomputed dots, not 10)."""
    plain, plain_hlo = _grads_and_hlo(False)
    got, hlo = _grads_and_hlo(True, checkpoint_all_but_last=1)
    for name in plain:
        torch.testing.assert_close(got[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert hlo.count(" dot(") == plain_hlo.count(" dot(") + 5
    model = _wrapped_gpt2(True, checkpoint_all_but_last=1)
    x, _ = batch("gpt2", 0)
    model(x.to(torch_xla.device()))
    first, last = model.transformer.h
    from xla_fsdp.unit_state import state_of

    assert (state_of(first).keeps_activations, state_of(last).keeps_activations) == (False, True)


@pytest.mark.parametrize("extra,message", [
    ({"activation_checkpointing": True, "checkpoint_all_but_last": 2},
     r"checkpoint_all_but_last=2 would leave none of the 2 checkpointed units recomputing: give at most 1"),
    ({"activation_checkpointing": False, "checkpoint_all_but_last": 1},
     r"checkpoint_all_but_last=1, but no unit is checkpointed: turn on activation_checkpointing=True"),
])
def test_checkpoint_all_but_last_refuses_what_it_cannot_do(extra, message):
    model = build_model("gpt2")
    model = FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]), **extra)
    x, _ = batch("gpt2", 0)
    with pytest.raises(ValueError, match=message):
        model(x.to(torch_xla.device()))


def test_checkpoint_all_but_last_is_the_roots_choice():
    """Given to a unit but not to its root: refused at the first forward, not silently ignored."""
    model = build_model("gpt2")
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = FSDP(block, activation_checkpointing=True, checkpoint_all_but_last=1)
    model = FSDP(model)
    x, _ = batch("gpt2", 0)
    with pytest.raises(ValueError, match=r"wrapped with checkpoint_all_but_last=1 and its root with 0"):
        model(x.to(torch_xla.device()))
    for bad in (True, -1, 1.5):
        with pytest.raises(ValueError, match=r"checkpoint_all_but_last=.* is not valid"):
            FSDP(build_model("gpt2"), checkpoint_all_but_last=bad)


def test_checkpoint_module_before_or_after_wrapping_and_plain():
    x, y = batch("mlp", 1)

    def grads(prepare):
        model = prepare(build_model("mlp_nested"))
        dev = next(model.parameters()).device
        loss_fn("mlp", model, x.to(dev), y.to(dev)).backward()
        return {n: p.grad.cpu() for n, p in model.named_parameters()}

    def plain(m):
        xla_fsdp.checkpoint_module(m[2])
        return m

    def ckpt_then_wrap(m):  # torch_xla's order
        m[2] = FSDP(xla_fsdp.checkpoint_module(m[2]))
        return FSDP(m)

    def wrap_then_ckpt(m):
        m[2] = xla_fsdp.checkpoint_module(FSDP(m[2]))
        return FSDP(m)

    ref = grads(lambda m: m)
    for prepare in (plain, ckpt_then_wrap, wrap_then_ckpt):
        got = grads(prepare)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=f"{prepare.__name__}: {name}")


def test_checkpointing_keeps_fewer_bytes_for_backward():
    x, y = batch("gpt2", 2)
    measured = {}
    for ckpt in (False, True):
        model = build_model("gpt2")
        for block in model.transformer.h if ckpt else []:
            xla_fsdp.checkpoint_module(block)
        with saved_activation_bytes() as stats:
            loss = loss_fn("gpt2", model, x, y)
        loss.backward()
        measured[ckpt] = stats["bytes"]
    # blocks keep only their inputs; embeddings, final norm and the head keep theirs
    assert measured[True] < 0.5 * measured[False], measured
