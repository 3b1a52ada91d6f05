"""[Note: Adafactor on stored stacks]: Hugging Face's Adafactor given a stored stack (d0, L, *rest)
updates each layer as it updates that layer's own parameter, for every option of its rule.

On the host (plain torch, no XLA): the same gradients go to L per-layer parameters under one
Adafactor and to their stack under another; after several steps every layer's slice of the stack,
and of its state, equals the per-layer run's. The stacks sharded and trained in both engines are
in test_scan_layers.py and test_stored_stacks.py.
"""
from __future__ import annotations

import pytest
import torch
from transformers.optimization import Adafactor

from xla_fsdp.layer_scan import stored_stacks

LAYERS = 3
SHAPES = {"weight": (5, 7), "conv": (4, 3, 6), "bias": (5,), "gain": ()}
OPTIONS = {
    # HF Trainer's --optim adafactor (the recipe)
    "trainer": dict(lr=1e-2, scale_parameter=False, relative_step=False),
    # Adafactor's own defaults, with a first moment and weight decay: the step scales per layer
    "relative": dict(beta1=0.9, weight_decay=0.1),
    "warmup": dict(warmup_init=True, clip_threshold=0.5, weight_decay=0.05),
}


def _stack(tensors):
    return torch.stack(tensors) if tensors[0].dim() == 0 else torch.stack(tensors, dim=1)


def _layer(stack: torch.Tensor, i: int) -> torch.Tensor:
    return stack[i] if stack.dim() == 1 else stack[:, i]


def _runs(options: dict, dtype=torch.float32, steps: int = 4):
    stored_stacks.install_optimizer_hooks()
    g = torch.Generator().manual_seed(0)
    layers = {n: [torch.nn.Parameter((torch.randn(s, generator=g) * (1 + i)).to(dtype)) for i in range(LAYERS)]
              for n, s in SHAPES.items()}
    stacks = {n: torch.nn.Parameter(_stack([p.detach().clone() for p in ps])) for n, ps in layers.items()}
    for p in stacks.values():
        p._xla_fsdp_stacked = True
    other = torch.nn.Parameter(torch.randn(6, 2, generator=g))  # not stacked: Adafactor's own step
    other_ref = torch.nn.Parameter(other.detach().clone())
    per_layer = Adafactor([p for ps in layers.values() for p in ps] + [other_ref], **options)
    stacked = Adafactor(list(stacks.values()) + [other], **options)
    for _ in range(steps):
        for n, ps in layers.items():
            grads = [torch.randn(SHAPES[n], generator=g).to(dtype) for _ in ps]
            for p, grad in zip(ps, grads):
                p.grad = grad
            stacks[n].grad = _stack(grads)
        other.grad = torch.randn(6, 2, generator=g)
        other_ref.grad = other.grad.clone()
        before = {n: s.grad for n, s in stacks.items()}
        per_layer.step()
        stacked.step()
        assert all(stacks[n].grad is before[n] for n in stacks)  # put back after the step
    return layers, stacks, per_layer, stacked, (other, other_ref)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_layer_of_a_stack_steps_as_its_own_parameter(name):
    layers, stacks, per_layer, stacked, (other, other_ref) = _runs(OPTIONS[name])
    for n, ps in layers.items():
        for i, p in enumerate(ps):
            torch.testing.assert_close(_layer(stacks[n].detach(), i), p.detach(), rtol=2e-6, atol=1e-7, msg=f"{n}.{i}")
            ref, got = per_layer.state[p], stacked.state[stacks[n]]
            assert got["step"] == ref["step"] == 4
            torch.testing.assert_close(got["RMS"][i], ref["RMS"], rtol=2e-6, atol=0)
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_row"):  # the layers on dim 1, as the stack
                if key in ref:
                    assert got[key].shape[0] == stacks[n].shape[0] or stacks[n].dim() == 1
                    torch.testing.assert_close(_layer(got[key], i), ref[key], rtol=2e-6, atol=1e-8, msg=key)
            if "exp_avg_sq_col" in ref:  # the layers on dim 0
                torch.testing.assert_close(got["exp_avg_sq_col"][i], ref["exp_avg_sq_col"], rtol=2e-6, atol=1e-8)
            assert set(got) == set(ref)
    torch.testing.assert_close(other, other_ref, rtol=0, atol=0)
    # the stack moved: a step that skipped it would leave layer 0 of the weight at its start
    assert not torch.equal(_layer(stacks["weight"].detach(), 0), torch.zeros(5, 7))


def test_bfloat16_stacks_step_in_float32_as_adafactor_does():
    layers, stacks, *_ = _runs(OPTIONS["trainer"], dtype=torch.bfloat16)
    for n, ps in layers.items():
        for i, p in enumerate(ps):
            assert stacks[n].dtype == torch.bfloat16
            torch.testing.assert_close(_layer(stacks[n].detach(), i), p.detach(), rtol=0, atol=0, msg=f"{n}.{i}")


def test_a_closure_and_other_per_tensor_optimizers_are_refused():
    stored_stacks.install_optimizer_hooks()
    stack = torch.nn.Parameter(torch.ones(4, LAYERS, 2))
    stack._xla_fsdp_stacked = True
    stack.grad = torch.ones_like(stack)
    ada = Adafactor([stack], lr=1e-2, scale_parameter=False, relative_step=False)
    with pytest.raises(TypeError, match="takes no closure"):
        ada.step(lambda: torch.tensor(0.0))
    assert stack.grad is not None and torch.equal(stack.detach(), torch.ones(4, LAYERS, 2))

    class MyAdafactor(Adafactor):  # a subclass may change the rule: not run per layer
        pass

    with pytest.raises(TypeError, match='scan_layers="per_step"') as e:
        MyAdafactor([stack], lr=1e-2, scale_parameter=False, relative_step=False).step()
    assert "MyAdafactor" in str(e.value) and "transformers.optimization.Adafactor" in str(e.value)
    with pytest.raises(TypeError, match="torch.optim.Adafactor is not"):
        torch.optim.Adafactor([stack]).step()
