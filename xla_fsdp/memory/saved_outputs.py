"""The outputs a recomputation policy saves, taken in the forward and handed to the recomputation.

[Note: saved outputs]
A checkpointed forward runs without autograd; hooks on the modules the policy names (`saved_modules` in
remat_policy.py) keep their outputs, in call order. In backward the block runs again, and the same hooks replace
each of those modules' recomputed output by the kept one (`_Kept`): what follows reads the forward's values, and
the gradient reaching the kept value goes to the recomputed output, so the module's own backward (the matmul's:
its input and weight) runs as without a policy. Nothing reads the recomputed output's value, so XLA drops the
matmul that made it: the recomputation skips exactly the saved matmuls. The hooks count: a recomputation that
calls the modules another number of times than the forward did is an error, not a mismatched pairing.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Sequence

import torch
import torch.nn as nn


def as_output_of(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """`output`, computed from `module`'s weights by code that does not call it (the head-major projections around
    the attention kernel), passed through `module`'s forward hooks as if it had returned it, so a policy that saves
    the module's output saves this one; several calls for one module (GPT-2's q, k and v of its one c_attn) are
    saved one by one."""
    for hook in list(module._forward_hooks.values()):
        got = hook(module, inputs, output)
        if got is not None:
            output = got
    return output


class _Kept(torch.autograd.Function):
    """The kept `saved` in place of `recomputed`; the gradient goes to `recomputed`."""

    @staticmethod
    def forward(ctx, recomputed: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        return saved.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _only_tensor(module: nn.Module, output) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"remat_policy: {type(module).__name__} returned {type(output).__name__}, not a tensor; "
                         "a policy saves the outputs of matmul modules that return one tensor")
    return output


def _check_called(modules: Sequence[nn.Module], calls: int) -> None:
    """A policy whose modules the block never called would save nothing, silently: refused."""
    if modules and not calls:
        names = sorted({type(m).__name__ for m in modules})
        raise ValueError(f"remat_policy: the block ran without calling the {len(modules)} modules its policy saves "
                         f"({', '.join(names)}): its forward computes them another way (reading their weights "
                         "directly), so nothing would be saved. Give such code `as_output_of(module, inputs, out)` "
                         "(xla_fsdp/memory/saved_outputs.py) for each result, or choose \"full\"")


@contextlib.contextmanager
def _hooked(modules: Sequence[nn.Module], hook) -> Iterator[None]:
    """`hook` on the forward of each of `modules` while the block runs."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def capturing(modules: Sequence[nn.Module]) -> Iterator[List[torch.Tensor]]:
    """The outputs of `modules` while the block runs, in call order."""
    kept: List[torch.Tensor] = []

    def hook(module, _args, output):
        kept.append(_only_tensor(module, output).detach())

    with _hooked(modules, hook):
        yield kept
    _check_called(modules, len(kept))


@contextlib.contextmanager
def substituting(modules: Sequence[nn.Module], kept: Sequence[torch.Tensor]) -> Iterator[None]:
    """While the block is recomputed, each call of `modules` returns the next of `kept`."""
    used = [0]

    def hook(module, _args, output):
        at = used[0]
        if at >= len(kept):
            raise RuntimeError(f"remat_policy: the recomputation called the saved modules more often than the "
                               f"forward did ({len(kept)} outputs kept); the block's forward must call them "
                               "alike both times")
        used[0] += 1
        return _Kept.apply(_only_tensor(module, output), kept[at])

    with _hooked(modules, hook):
        yield
    if used[0] != len(kept):
        raise RuntimeError(f"remat_policy: the recomputation called the saved modules {used[0]} times, the forward "
                           f"{len(kept)}; the block's forward must call them alike both times")


# [Note: saved outputs under AOTAutograd] The GSPMD engine's scan traces the layer with AOTAutograd and a
# partitioner decides what the forward saves (layer_scan/gspmd/scan_glue.py). There the hooks mark the outputs to
# save with `saved_as`, an identity op the trace keeps as a node of its own (the gradient passes through it
# unchanged), and the partitioner saves the marked nodes.
@functools.lru_cache(maxsize=None)
def tag_op():
    """torch.ops.xla_fsdp.saved_as (registered on first use): identity; `tag` names why it is saved."""
    @torch.library.custom_op("xla_fsdp::saved_as", mutates_args=())
    def saved_as(t: torch.Tensor, tag: str) -> torch.Tensor:
        return t.clone()

    @saved_as.register_fake
    def _(t: torch.Tensor, tag: str) -> torch.Tensor:
        return torch.empty_like(t)

    saved_as.register_autograd(lambda ctx, grad: (grad, None))
    return torch.ops.xla_fsdp.saved_as.default


@contextlib.contextmanager
def marking(modules: Sequence[nn.Module], tag: str = "output") -> Iterator[None]:
    """While traced, the outputs of `modules` pass through `saved_as(..., tag)`."""
    op = tag_op()
    calls = [0]

    def hook(module, _args, output):
        calls[0] += 1
        return op(_only_tensor(module, output), tag)

    with _hooked(modules, hook):
        yield
    _check_called(modules, calls[0])
