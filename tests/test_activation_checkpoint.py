"""Per-layer gradient checkpointing: identical gradients, recomputation visible
in the XLA graph, fewer bytes kept for backward; with nested units and bf16."""
import pytest
import torch

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.memory.activations import saved_activation_bytes
from parity_cases import batch, build_model, loss_fn

torch_xla = pytest.importorskip("torch_xla")


def _wrapped_gpt2(checkpoint: bool, dtype=None):
    model = build_model("gpt2")
    kwargs = {"auto_wrap_policy": xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
              "activation_checkpointing": checkpoint}
    if dtype is not None:
        kwargs["compute_dtype"] = dtype
    return FSDP(model, **kwargs)


def _grads_and_hlo(checkpoint: bool, dtype=None):
    model = _wrapped_gpt2(checkpoint, dtype)
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
