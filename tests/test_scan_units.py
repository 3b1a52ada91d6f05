"""scan_layers on the collectives engine ([Note: scanning units of the collectives engine]), in this
process on XLA:CPU at world size 1: the loop against the same model unscanned, and bad input.

The single controller's parity at 4 and 8 devices (collectives inside the loop, rings, bf16) runs in
tests/test_single_controller.py (cases gpt2_ckpt_scan*). GPT-2 and the Llama scanned here run under
`pytest -m slow`; the default run keeps the small stack, dropout in the loop and the refusals."""
import pytest
import torch
import torch.nn as nn

import xla_fsdp
from xla_fsdp import FSDP

torch_xla = pytest.importorskip("torch_xla")

from parity_cases import batch, loss_fn  # noqa: E402

POLICY = xla_fsdp.wrap.transformer_policy(["GPT2Block"])


def _checkpointed(m, **kw):
    return FSDP(xla_fsdp.checkpoint_module(m), **kw)


def _steps(model, loss_of, count: int, opt=None):
    """`count` optimizer steps of `loss_of(model, step)`; the losses."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for step in range(count):
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        losses.append(float(loss.detach()))
    return losses


def _params(model):
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _same(a, b, rtol: float) -> None:
    (losses, params), (ref_losses, ref) = a, b
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=rtol / 10)
    for name, want in ref.items():
        torch.testing.assert_close(params[name], want, rtol=rtol, atol=rtol / 10)


def _gpt2(scan: bool, steps: int, dropout: float = 0.0, fixed: bool = False):
    from transformers import GPT2LMHeadModel

    from parity_cases import gpt2_config

    torch.manual_seed(0)
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(0)  # the device's RNG draws the dropout keys: the same masks whatever ran before in this process
    config = gpt2_config()
    config.n_layer = 3
    config.resid_pdrop = dropout
    device = torch_xla.device()
    model = FSDP(GPT2LMHeadModel(config).to(device), auto_wrap_policy=POLICY,
                 auto_wrapper_callable=_checkpointed, scan_layers=scan)

    def loss_of(m, step):
        x, y = batch("gpt2", 0 if fixed else step)
        return loss_fn("gpt2", m, x.to(device), y.to(device))

    return model, _steps(model, loss_of, steps)


# -m slow: scan against unscanned at world size 1 stays in the default run with the small stack
# (test_scan_trains_the_small_stack_like_unscanned); GPT-2's checkpointed blocks scanned against unscanned,
# collectives inside the loop, in tests/test_single_controller.py (gpt2_ckpt_scan at 4 devices, with rings at 8)
@pytest.mark.slow
def test_scanned_blocks_train_like_the_unscanned_model_without_dropout():
    from xla_fsdp.layer_scan.scanned_list import ScannedLayers

    ref, ref_losses = _gpt2(scan=False, steps=4)
    got, losses = _gpt2(scan=True, steps=4)
    assert isinstance(got.transformer.h, ScannedLayers)
    _same((losses, _params(got)), (ref_losses, _params(ref)), 1e-5)
    # the same state dict keys as the unscanned model (checkpoints load either way)
    assert list(got.state_dict()) == list(ref.state_dict())


def test_dropout_in_the_loop_learns_a_fixed_batch():
    """With dropout the loop draws keyed masks ([Note: dropout under scan]; the masks themselves are
    checked exactly on the SPMD engine, tests/test_scan_layers.py). A recomputation that drew another
    mask than its forward would make the gradients wrong; on one batch the loss must still fall."""
    _, losses = _gpt2(scan=True, steps=6, dropout=0.1, fixed=True)
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
    kw.setdefault("auto_wrapper_callable", _checkpointed)
    return FSDP(model.to(torch_xla.device()), scan_layers=True, **kw)


def test_layers_that_differ_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="layer 1 of layers has .* every scanned layer must be identical"):
        _wrap(_Stack([16, 32]))


def test_a_policy_that_does_not_wrap_the_repeated_layer_is_refused():
    with pytest.raises(ValueError, match="found no nn.ModuleList whose layers are all wrapped units"):
        _wrap(_Stack([16, 16]), auto_wrap_policy=xla_fsdp.wrap.transformer_policy([nn.Linear]))
    with pytest.raises(ValueError, match="scans the repeated layer the auto_wrap_policy wraps"):
        FSDP(_Stack([16, 16]).to(torch_xla.device()), scan_layers=True)


def test_layers_that_keep_activations_are_refused():
    model = _wrap(_Stack([16, 16]), auto_wrapper_callable=None)  # not checkpointed
    with pytest.raises(ValueError, match="recomputes every layer. Turn on activation checkpointing"):
        model(torch.randn(4, 8, device=torch_xla.device()))


def test_scan_trains_the_small_stack_like_unscanned():
    def run(scan):
        torch.manual_seed(1)
        model = FSDP(_Stack([16, 16, 16, 16]).to(torch_xla.device()), scan_layers=scan,
                     auto_wrap_policy=BLOCKS, auto_wrapper_callable=_checkpointed)

        def loss_of(m, step):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(torch_xla.device())
            return m(x).pow(2).mean()

        losses = _steps(model, loss_of, 3, torch.optim.SGD(model.parameters(), lr=0.1))
        return losses, _params(model)

    unscanned = run(False)
    _same(run(True), unscanned, 1e-6)
    _same(run("per_step"), unscanned, 1e-6)  # one process per device: both keep per-layer parameters


# -m slow: the scanned Llama (rotary tables and mask carried into the loop) trains on the collectives engine
# in the default run through run_clm, tests/test_run_clm_llama.py (collectives_scan: the unsharded run's losses)
@pytest.mark.slow
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
                     auto_wrapper_callable=_checkpointed, scan_layers=scan)

        def loss_of(m, step):
            ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step)).to(device)
            return m(input_ids=ids, labels=ids).loss

        return _steps(model, loss_of, 3), _params(model)

    _same(run(True), run(False), 1e-6)


class _Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_the_loop_runs_the_layer_as_it_is_at_the_first_call():
    """What is mixed into the layers after wrapping (run_clm gives GPT-2's attention its head-major
    forward then) runs inside the loop too: the body's copy of layer 0 is made at the first call."""
    def run(scan):
        torch.manual_seed(1)
        model = FSDP(_Stack([16, 16, 16]).to(torch_xla.device()), scan_layers=scan,
                     auto_wrap_policy=BLOCKS, auto_wrapper_callable=_checkpointed)
        for layer in model.layers:
            layer.out.__class__ = _Doubled
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(torch_xla.device())
        out = model(x)
        torch_xla.sync()
        return out.detach().cpu()

    torch.testing.assert_close(run(True), run(False), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_loop_reads_a_shifted_slice_in_place(reverse):
    """`region_loop.while_loop` with `shifts`: trip i reads slice (i + k) mod trips of that input,
    as the scanned layers read the next (forward) or previous (backward) layer without a rolled copy."""
    from xla_fsdp.collective_engine.region_loop import while_loop

    device = torch_xla.device()
    xs = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    other = torch.arange(5, dtype=torch.float32) * 10

    def body(carry, x):
        ahead, behind, own = x
        return [carry[0] + own], [ahead, behind]

    final, (got_ahead, got_behind) = while_loop(
        body, [torch.zeros((), device=device)], [xs.to(device), xs.to(device), other.to(device)],
        reverse=reverse, shifts=[1, -1, 0])
    torch_xla.sync()
    assert torch.equal(got_ahead.cpu(), torch.roll(xs, -1, 0))
    assert torch.equal(got_behind.cpu(), torch.roll(xs, 1, 0))
    assert float(final[0].cpu()) == float(other.sum())


def test_traced_for_a_tpu_the_loops_outputs_start_unwritten(monkeypatch):
    """[Note: the loop's output buffers]: for a TPU (here: traced by the ahead-of-time check) the
    buffer of the trips' outputs is libtpu's AllocateBuffer, not a write of zeros; on XLA:CPU it is
    zeros (the parity tests run that)."""
    from xla_fsdp.runtime.environment import AOT as TRACE_ENV
    from xla_fsdp.collective_engine.region_loop import while_loop

    device = torch_xla.device()
    xs = torch.ones(6, 8, 128, device=device)

    def body(carry, x):
        return [carry[0] + x[0]], [x[0] * 2]

    hlo = {}
    for env in ("1", None):
        if env:
            monkeypatch.setenv(TRACE_ENV, env)
        else:
            monkeypatch.delenv(TRACE_ENV)
        _, (ys,) = while_loop(body, [torch.zeros(8, 128, device=device)], [xs])
        hlo[env] = torch_xla._XLAC._get_xla_tensors_hlo([ys])
    assert 'custom_call_target="AllocateBuffer"' in hlo["1"] and "f32[6,8,128]" in hlo["1"]
    assert "AllocateBuffer" not in hlo[None]
