"""Units of different compute dtypes nested in each other ([Note: every unit casts its own
inputs]), on XLA:CPU at world size 1, executed.

bf16 units inside an fp32 root (code written for torch_xla's FSDP does this) train like an
unsharded reference that casts at the same places, and like torch_xla's own FSDP; the
opposite nesting warns at wrap time, naming the unit and the fix."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.collective_engine.precision import MixedPrecisionNestingWarning

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.core.xla_model as xm  # noqa: E402

STEPS = 3
BF16 = dict(rtol=2e-3, atol=1e-4)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


class _Bf16Linear(nn.Module):
    """The reference's middle layer: fp32 master weights, inputs and weights cast to bf16."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return F.linear(x.bfloat16(), self.weight.bfloat16(), self.bias.bfloat16())


class _ReluToFloat(nn.Module):
    """After the bf16 layer: torch_xla promotes the bf16 activation where it meets the fp32
    last layer; eager CPU refuses the mix, so the reference casts here."""

    def forward(self, x):
        return torch.relu(x).float()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, device) -> tuple:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
        loss.backward()
        opt.step()
        if device.type == "xla":
            xm.mark_step()
        losses.append(loss.item())
    return losses


def _wrapped(wrapper) -> nn.Module:
    dev = torch_xla.device()
    m = _model().to(dev)
    m[2] = wrapper(m[2], compute_dtype=torch.bfloat16)
    return wrapper(m)


def test_bf16_unit_inside_fp32_root_trains_like_the_reference_and_torch_xla_fsdp():
    ref = _model()
    ref[2], ref[3] = _Bf16Linear(ref[2]), _ReluToFloat()
    ref_losses = _train(ref, torch.device("cpu"))

    ours = _wrapped(FSDP)
    losses = _train(ours, torch_xla.device())
    # bf16 matmuls: XLA:CPU and eager CPU round differently (a lost cast would not compile at all)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **BF16)
    with FSDP.summon_full_params(ours):
        got = {n.replace("_fsdp_wrapped_module.", ""): p.detach().cpu() for n, p in ours.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **BF16, msg=name)

    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDPv1

    v1_losses = _train(_wrapped(FSDPv1), torch_xla.device())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(v1_losses), rtol=1e-5, atol=1e-6)


def test_fp32_unit_inside_bf16_unit_warns_with_the_fix():
    m = _model()
    m[2] = FSDP(m[2])
    with pytest.warns(MixedPrecisionNestingWarning, match=r"unit\(s\) '2' inside Sequential compute in float32 "
                      r"while Sequential computes in bfloat16.*same compute_dtype.*auto_wrap_policy"):
        FSDP(m, compute_dtype=torch.bfloat16)


def test_matching_or_auto_wrapped_units_do_not_warn():
    m = _model()
    m[2] = FSDP(m[2], compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixedPrecisionNestingWarning)
        FSDP(m, compute_dtype=torch.bfloat16)
        FSDP(copy.deepcopy(_model()), compute_dtype=torch.bfloat16, auto_wrap_policy=xla_fsdp.always_wrap_policy)
        inner = _model()
        inner[2] = FSDP(inner[2])
        FSDP(inner)  # fp32 inside fp32


def test_only_the_units_a_unit_calls_are_named():
    """An fp32 unit inside an fp32 unit inside a bf16 root: the root names the outer one only
    (the inner one gets fp32 inputs from it)."""
    m = _model()
    block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    block[2] = FSDP(block[2])
    m[2] = FSDP(block)
    with pytest.warns(MixedPrecisionNestingWarning) as seen:
        FSDP(m, compute_dtype=torch.bfloat16)
    assert len(seen) == 1 and "unit(s) '2' inside" in str(seen[0].message), [str(w.message) for w in seen]
