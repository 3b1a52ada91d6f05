"""The SPMD engine's partitionable layer norm (xla_fsdp/gspmd_engine/norms.py) against
PyTorch's own, on the CPU: values, gradients, low precision, installation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from xla_fsdp.gspmd_engine.norms import install_partitionable_layer_norms, layer_norm


def _inputs(dtype=torch.float32, affine=True):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 5, 16, generator=gen) + 2).to(dtype)
    w = torch.randn(16, generator=gen).to(dtype) if affine else None
    b = torch.randn(16, generator=gen).to(dtype) if affine else None
    return x, w, b


@pytest.mark.parametrize("affine", [True, False])
def test_values_and_gradients_match_torch_layer_norm(affine):
    x, w, b = _inputs(affine=affine)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    ours = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    upstream = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))

    want = F.layer_norm(leaves[0], (16,), *(leaves[1:] or (None, None)), eps=1e-5)
    got = layer_norm(ours[0], (16,), *(ours[1:] or (None, None)), eps=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    for a, e in zip(ours, leaves):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-5, atol=1e-5)


def test_normalizes_over_several_trailing_dims():
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(2))
    w = torch.rand(4, 5) + 0.5
    got = layer_norm(x, (4, 5), w, None, eps=1e-6)
    torch.testing.assert_close(got, F.layer_norm(x, (4, 5), w, None, eps=1e-6), rtol=1e-6, atol=1e-6)


def test_bf16_statistics_in_fp32():
    x, w, b = _inputs(torch.bfloat16)
    got = layer_norm(x, (16,), w, b, eps=1e-5)
    assert got.dtype == torch.bfloat16
    want = F.layer_norm(x.float(), (16,), w.float(), b.float(), eps=1e-5)
    # Only the final roundings to bf16 differ (8 bits of mantissa).
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=3e-2)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(8,\).*\(2, 3\)"):
        layer_norm(torch.zeros(2, 3), (8,), None, None, eps=1e-5)


def test_install_changes_plain_layer_norms_only_and_keeps_outputs():
    class CustomNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), CustomNorm(8), nn.LayerNorm(8, elementwise_affine=False)
    )
    x = torch.randn(3, 8)
    before = model(x)
    assert install_partitionable_layer_norms(model) == 2
    assert "forward" not in model[3].__dict__  # the subclass keeps its forward
    assert "forward" in model[1].__dict__ and "forward" in model[4].__dict__
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)
    # A second install finds nothing left to change.
    assert install_partitionable_layer_norms(model) == 0
    # A forward set on the instance (another wrapper's) is left alone.
    other = nn.LayerNorm(8)
    other.forward = lambda t: t
    assert install_partitionable_layer_norms(other) == 0
    assert other(x) is x
    # The parameters are still the module's (no copies captured).
    with torch.no_grad():
        model[1].weight.mul_(0)
        model[1].bias.fill_(0.25)
    torch.testing.assert_close(model[1](x), torch.full((3, 8), 0.25))
