"""What a scanned layer's body is traced with: the scanned-layer flag, and weight slices kept apart.

[Note: fusion fences in the scanned body]
Fences (an XLA optimization barrier around a copy, so a value is written where it is made and read where it is used and
neither side fuses into the other) were once put in the scanned body (Llama's and GPT-2's attention input and output,
every dropout's input): libtpu fuses element-wise work (the recomputed layer norm, dropout's per-element hash) into the
matmuls around it, and such kernels took longer to compile. None is left: with q, k and v kept apart ([Note: one kernel
for q, k and v], below) their compile time no longer showed, while their memory traffic cost every step (measured: 2B
GPT-2 on v4-8 2.428 -> 2.411 s without them; bench/results/scan_compile_2026-12-01.json). Removing only some gained
nothing: the output projection, its bias, the residual's dropout and the residual add fuse only when none is fenced.
"""
from __future__ import annotations

import threading

import torch

from xla_fsdp.runtime.barrier import optimization_barrier

_state = threading.local()


def enter() -> None:
    """A scanned layer's body is being traced (keyed_random.KeyedRandom enters)."""
    _state.depth = getattr(_state, "depth", 0) + 1


def leave() -> None:
    _state.depth = getattr(_state, "depth", 1) - 1


def in_scanned_layer() -> bool:
    return getattr(_state, "depth", 0) > 0


def _barrier(t: torch.Tensor) -> torch.Tensor:
    return optimization_barrier([t])[0]


class _Apart(torch.autograd.Function):
    """A barrier in the forward and around the gradient in the backward."""

    @staticmethod
    def forward(ctx, t):
        return _barrier(t)

    @staticmethod
    def backward(ctx, grad):
        return _barrier(grad)


def apart(t: torch.Tensor) -> torch.Tensor:
    """[Note: one kernel for q, k and v]

    A slice of a weight, written as a tensor of its own in the forward and its gradient written on its own before it
    joins the weight's gradient, when traced for a scanned layer on XLA; else `t`. GPT-2 keeps q, k and v in one weight
    (c_attn). Sliced inside their matmuls, the three projections are three kernels that differ only in the slice's
    offset, and libtpu compiles each, in the forward, for the input's gradient and for the weight's. libtpu compiles a
    kernel once when another in the program is the same computation on operands of the same shapes and layouts; with
    the slices apart the three are the same kernel in each of the three places. The cost is a copy of each slice and of
    its gradient (measured: the 2B for v4-8 compiles in 17.2 s instead of 20.9 s; the 64B for v4-256, whose slices are
    far larger, pays 0.167 s of a 17.7 s step; docs/scan.md, "The blog's 64B on v4-256")."""
    return _Apart.apply(t) if in_scanned_layer() and t.device.type == "xla" else t
