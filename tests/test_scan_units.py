"""scan_layers on the collectives engine ([Note: scanning units of the collectives engine]), in this
process on XLA:CPU at world size 1: the loop against the same model unscanned, and bad input.

The single controller's parity at 4 and 8 devices (collectives inside the loop, rings, bf16) runs in
tests/test_single_controller.py (cases gpt2_ckpt_scan*)."""
import pytest
import torch
import torch.nn as nn

import xla_fsdp
from xla_fsdp import FSDP

torch_xla = pytest.importorskip("torch_xla")

from parity_cases import batch, build_model, loss_fn  # noqa: E402

POLICY = xla_fsdp.wrap.transformer_policy(["GPT2Block"])


def _train(scan: bool, steps: int = 3, layers: int = 3, fixed: bool = False):
    from transformers import GPT2LMHeadModel

    from parity_cases import gpt2_config

    torch.manual_seed(0)
    config = gpt2_config()
    config.n_layer = layers
    config.resid_pdrop = 0.1  # dropout inside the loop: each layer its own mask
    model = GPT2LMHeadModel(config)
    device = torch_xla.device()
    model = FSDP(model.to(device), auto_wrap_policy=POLICY,
                 auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw),
                 scan_layers=scan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for step in range(steps):
        x, y = batch("gpt2", 0 if fixed else step)
        x, y = x.to(device), y.to(device)
        loss = loss_fn("gpt2", model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        losses.append(float(loss.detach()))
    return model, losses


def test_scanned_blocks_train_like_the_unscanned_model_without_dropout():
    from xla_fsdp.layer_scan.scanned_list import ScannedLayers

    torch.manual_seed(0)
    ref, ref_losses = _train_no_dropout(scan=False)
    got, losses = _train_no_dropout(scan=True)
    assert isinstance(got.transformer.h, ScannedLayers)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    want = {n: p.detach().cpu() for n, p in ref.named_parameters()}
    for name, p in got.named_parameters():
        rel = float((p.detach().cpu() - want[name]).norm() / want[name].norm().clamp_min(1e-12))
        assert rel < 1e-5, (name, rel)
    # the same state dict keys as the unscanned model (checkpoints load either way)
    assert list(got.state_dict()) == list(ref.state_dict())


def _train_no_dropout(scan: bool):
    from transformers import GPT2LMHeadModel

    from parity_cases import gpt2_config

    torch.manual_seed(0)
    config = gpt2_config()
    config.n_layer = 3
    model = GPT2LMHeadModel(config)
    device = torch_xla.device()
    model = FSDP(model.to(device), auto_wrap_policy=POLICY,
                 auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw),
                 scan_layers=scan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for step in range(4):
        x, y = batch("gpt2", step)
        loss = loss_fn("gpt2", model, x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        losses.append(float(loss.detach()))
    return model, losses


def test_dropout_in_the_loop_learns_a_fixed_batch():
    """With dropout the loop draws keyed masks ([Note: dropout under scan]; the masks themselves are
    checked exactly on the SPMD engine, tests/test_scan_layers.py). A recomputation that drew another
    mask than its forward would make the gradients wrong; on one batch the loss must still fall."""
    _, losses = _train(scan=True, steps=6, fixed=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.9 * losses[0], losses


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(8, width)
        self.out = nn.Linear(width, 8)

    def forward(self, h):
        return h + self.out(torch.relu(self.fc(h)))


class _Stack(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.layers = nn.ModuleList(_Block(w) for w in widths)
        self.head = nn.Linear(8, 1)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


BLOCKS = xla_fsdp.wrap.transformer_policy([_Block])


def _wrap(model, **kw):
    kw.setdefault("auto_wrap_policy", BLOCKS)
    kw.setdefault("auto_wrapper_callable", lambda m, **k: FSDP(xla_fsdp.checkpoint_module(m), **k))
    return FSDP(model.to(torch_xla.device()), scan_layers=True, **kw)


def test_layers_that_differ_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="layer 1 of layers has .* every scanned layer must be identical"):
        _wrap(_Stack([16, 32]))


def test_a_policy_that_does_not_wrap_the_repeated_layer_is_refused():
    with pytest.raises(ValueError, match="found no nn.ModuleList whose layers are all wrapped units"):
        _wrap(_Stack([16, 16]), auto_wrap_policy=xla_fsdp.wrap.transformer_policy([nn.Linear]))
    with pytest.raises(ValueError, match="scans the repeated layer the auto_wrap_policy wraps"):
        FSDP(_Stack([16, 16]).to(torch_xla.device()), scan_layers=True)


def test_per_step_and_layers_that_keep_activations_are_refused():
    with pytest.raises(ValueError, match='pass scan_layers=True'):
        FSDP(_Stack([16, 16]), auto_wrap_policy=BLOCKS, scan_layers="per_step")
    model = _wrap(_Stack([16, 16]), auto_wrapper_callable=None)  # not checkpointed
    with pytest.raises(ValueError, match="recomputes every layer. Turn on activation checkpointing"):
        model(torch.randn(4, 8, device=torch_xla.device()))


def test_scan_trains_the_small_stack_like_unscanned():
    def run(scan):
        torch.manual_seed(1)
        model = _Stack([16, 16, 16, 16])
        kw = dict(auto_wrap_policy=BLOCKS,
                  auto_wrapper_callable=lambda m, **k: FSDP(xla_fsdp.checkpoint_module(m), **k))
        model = FSDP(model.to(torch_xla.device()), scan_layers=scan, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(4, 8, generator=gen).to(torch_xla.device())
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            out.append(float(loss.detach()))
        return out, {n: p.detach().cpu() for n, p in model.named_parameters()}

    ref_losses, ref = run(False)
    losses, got = run(True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)


def test_llama_layers_with_rotary_arguments_scan_like_unscanned():
    """Llama's layers take the rotary tables and the mask as arguments: they enter the loop as
    carried tensors; the slice `self.layers[:n]` its forward takes is scanned too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def run(scan):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        device = torch_xla.device()
        model = FSDP(LlamaForCausalLM(cfg).to(device),
                     auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["LlamaDecoderLayer"]),
                     auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw),
                     scan_layers=scan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 128, (4, 16), generator=gen).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            losses.append(float(loss.detach()))
        return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}

    ref_losses, ref = run(False)
    losses, got = run(True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)
