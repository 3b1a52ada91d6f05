"""xla_fsdp/layer_scan/fences.py: the scanned-layer flag and [Note: one kernel for q, k and v]'s
`apart`, a barrier inside a scanned layer's traced body and the slice itself anywhere else.
[Note: fusion fences in the scanned body] says why no value of the body is fenced any more; the
dropout test below checks that."""
from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402

from xla_fsdp.layer_scan import fences  # noqa: E402
from xla_fsdp.layer_scan.keyed_random import KeyedRandom, keyed_dropout  # noqa: E402


def _hlo(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_tensors_hlo([t])


def test_the_scanned_layer_flag_is_set_only_inside_keyed_random():
    assert not fences.in_scanned_layer()
    with KeyedRandom(torch.zeros(1, dtype=torch.int32), "test"):
        assert fences.in_scanned_layer()
        with KeyedRandom(torch.zeros(1, dtype=torch.int32), "inner"):
            assert fences.in_scanned_layer()
        assert fences.in_scanned_layer()
    assert not fences.in_scanned_layer()


def test_apart_of_a_cpu_tensor_in_a_scanned_layer_is_the_tensor():
    cpu = torch.randn(3)
    with KeyedRandom(torch.zeros(1, dtype=torch.int32), "test"):
        assert fences.apart(cpu) is cpu  # not an XLA tensor: nothing to keep apart


def test_dropout_in_a_scanned_layer_is_not_fenced_and_draws_the_same_mask():
    """Dropout's input used to be fenced inside the body; unfenced, libtpu fuses the residual's
    output projection, dropout and add (0.7% of the 2B's PROJECTED step)."""
    device = torch_xla.device()
    key = torch.arange(4, dtype=torch.int32, device=device)
    x = torch.randn(4, 16, 32, device=device)
    with KeyedRandom(key, "test"):
        inside = keyed_dropout(x, 0.5, key, 0)
    outside = keyed_dropout(x, 0.5, key, 0)
    assert "opt-barrier" not in _hlo(inside)
    assert torch.equal(inside.cpu(), outside.cpu())
    kept = (outside != 0).float().mean().item()
    assert 0.3 < kept < 0.7, kept  # p = 0.5: a mask, not all or nothing


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
