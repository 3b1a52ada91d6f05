"""Fusion fences in a scanned layer's body: what libtpu compiles fastest for the same arithmetic.

[Note: fusion fences in the scanned body]
The scanned step is compiled for its time to the first step, and most of that time is libtpu
lowering the loop bodies' kernels, two at a time on a 2-core host (docs/scan.md, "Where the
rest of the 2B's compile goes"). libtpu fuses element-wise work into the matmuls it feeds or
follows, and such a kernel takes far longer to compile than the matmul alone: in the scanned
2B GPT-2's step for v4-8 each of the head-major q, k and v projections carried the layer norm
recomputed from the saved input (4 s of compile per kernel against about 2 s), and the output
projections carried dropout's per-element hash (libtpu's kernel dumps, 2026-11-30).

`fence(t)` gives XLA an optimization barrier around a copy of `t`: the value is written once
where it is made and read where it is used, so neither side fuses into the other. Inside a
scanned layer's body (both engines; nowhere else) Llama's head-major attention input
(attention/llama_heads.py), GPT-2's attention output and every dropout's input (keyed_random.py)
are fenced. (Llama's attention output and MLP input, fenced, bought little compile for
0.75-0.9% of PROJECTED step: left alone.) Same values, same gradients (the barrier is an
identity to autograd, which sees only the copy). The cost is memory traffic. GPT-2's attention
input was fenced too until 2026-12-01: since its q, k and v are one kernel ([Note: one kernel
for q, k and v]) the fence no longer bought compile time the host could measure (2B GPT-2 for
v4-8, four interleaved pairs, libtpu compile within this host's drift either way), and it cost
the step 12 ms (PROJECTED 2.440 -> 2.428 s with AdamW, 2.436 -> 2.425 s with Adafactor:
docs/scan.md).
"""
from __future__ import annotations

import threading

import torch

_state = threading.local()


def enter() -> None:
    """A scanned layer's body is being traced (keyed_random.KeyedRandom enters)."""
    _state.depth = getattr(_state, "depth", 0) + 1


def leave() -> None:
    _state.depth = getattr(_state, "depth", 1) - 1


def in_scanned_layer() -> bool:
    return getattr(_state, "depth", 0) > 0


def _barrier(t: torch.Tensor) -> torch.Tensor:
    import torch_xla

    out = t.clone()  # the barrier replaces its operand's value in place; the caller's tensor stays
    torch_xla._XLAC._xla_optimization_barrier_([out])
    return out


def _active(t: torch.Tensor) -> bool:
    """Whether `t` is being traced for a scanned layer on XLA, where fences apply."""
    return in_scanned_layer() and t.device.type == "xla"


def fence(t: torch.Tensor) -> torch.Tensor:
    """`t`, kept out of the fusions around it when traced for a scanned layer on XLA; else `t`."""
    return _barrier(t) if _active(t) else t


class _Apart(torch.autograd.Function):
    """A fence in the forward and around the gradient in the backward."""

    @staticmethod
    def forward(ctx, t):
        return _barrier(t)

    @staticmethod
    def backward(ctx, grad):
        return _barrier(grad)


def apart(t: torch.Tensor) -> torch.Tensor:
    """[Note: one kernel for q, k and v]

    A slice of a weight, written as a tensor of its own in the forward and its gradient written
    on its own before it joins the weight's gradient, when traced for a scanned layer on XLA;
    else `t`. GPT-2 keeps q, k and v in one weight (c_attn). Sliced inside their matmuls, the
    three projections are three kernels that differ only in the slice's offset, and libtpu
    compiles each (about 3 s apiece for the 2B on this host), in the forward, for the input's
    gradient and for the weight's. libtpu compiles a kernel once when another in the program
    is the same computation on operands of the same shapes and layouts; with the slices apart
    the three are the same kernel in each of the three places. The cost is a copy of each slice
    and of each slice's gradient (a [3072, 24, 128] bf16 tensor for the 2B)."""
    return _Apart.apply(t) if _active(t) else t
