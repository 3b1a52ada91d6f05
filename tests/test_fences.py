"""[Note: fusion fences in the scanned body] (xla_fsdp/layer_scan/fences.py): inside a scanned
layer's traced body a fence is an XLA optimization barrier around a copy, the same values and an
identity to autograd; anywhere else it is nothing. Scanned runs with fences are checked against
unscanned ones by the scan parity tests (tests/test_scan_layers.py, test_scan_units.py), and the
keyed dropout masks against their gradients in tests/test_scan_layers.py."""
from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402

from xla_fsdp.layer_scan import fences  # noqa: E402
from xla_fsdp.layer_scan.keyed_random import KeyedRandom, keyed_dropout  # noqa: E402


def _hlo(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_tensors_hlo([t])


def test_outside_a_scanned_layer_a_fence_is_nothing():
    t = torch.randn(4, 8, device=torch_xla.device())
    assert fences.fence(t) is t and not fences.in_scanned_layer()
    cpu = torch.randn(3)
    with KeyedRandom(torch.zeros(1, dtype=torch.int32), "test"):
        assert fences.fence(cpu) is cpu  # not an XLA tensor: nothing to fence


def test_inside_a_scanned_layer_a_fence_is_a_barrier_with_the_same_values_and_gradient():
    device = torch_xla.device()
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with KeyedRandom(torch.zeros(4, dtype=torch.int32, device=device), "test"):
        assert fences.in_scanned_layer()
        y = fences.fence(x * 2)
    assert not fences.in_scanned_layer()
    assert "opt-barrier" in _hlo(y)
    torch.testing.assert_close(y.detach().cpu(), (x * 2).detach().cpu())
    (y * torch.arange(8.0, device=device)).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * torch.arange(8.0).expand(4, 8))


def test_dropout_in_a_scanned_layer_fences_its_input_from_the_mask():
    device = torch_xla.device()
    key = torch.arange(4, dtype=torch.int32, device=device)
    x = torch.randn(4, 16, 32, device=device)
    with KeyedRandom(key, "test"):
        fenced = keyed_dropout(x, 0.5, key, 0)
    plain = keyed_dropout(x, 0.5, key, 0)  # outside a body: the same mask, no barrier
    assert "opt-barrier" in _hlo(fenced) and "opt-barrier" not in _hlo(plain)
    assert torch.equal(fenced.cpu(), plain.cpu())


def test_apart_fences_the_slice_and_its_gradient():
    """[Note: one kernel for q, k and v]: the slice is a barrier's output in the forward and its
    gradient goes through one before it joins the whole weight's; outside a body it is the slice."""
    device = torch_xla.device()
    w = torch.randn(6, 3, 5, device=device, requires_grad=True)
    x = torch.randn(4, 6, device=device)
    assert fences.apart(w[:, 1]).grad_fn is not None and "opt-barrier" not in _hlo(fences.apart(w[:, 1]))
    with KeyedRandom(torch.zeros(4, dtype=torch.int32, device=device), "test"):
        pieces = [fences.apart(w[:, i]) for i in range(3)]
    assert all("opt-barrier" in _hlo(p) for p in pieces)
    out = sum(torch.einsum("bi,ij->bj", x, p) * (i + 1) for i, p in enumerate(pieces))
    out.sum().backward()
    assert "opt-barrier" in _hlo(w.grad)
    want = torch.stack([x.cpu().sum(0)[:, None].expand(6, 5) * (i + 1) for i in range(3)], dim=1)
    torch.testing.assert_close(w.grad.cpu(), want)
    torch.testing.assert_close(pieces[2].detach().cpu(), w[:, 2].detach().cpu())
