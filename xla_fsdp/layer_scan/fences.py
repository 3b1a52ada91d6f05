"""What a scanned layer's body is traced with: the scanned-layer flag, and weight slices kept apart.

[Note: fusion fences in the scanned body]
The scanned step is compiled for its time to the first step, and most of that time is libtpu
lowering the loop bodies' kernels, two at a time on a 2-core host (in git history:
docs/scan.md before 595b4ed, "Where the rest of the 2B's compile goes"). Fences (an XLA optimization barrier around a copy, so a value
is written where it is made and read where it is used and neither side fuses into the other)
were put on 2026-11-30 on Llama's attention input, GPT-2's attention input and output and every
dropout's input in the scanned body: libtpu fuses element-wise work (the recomputed layer norm,
dropout's per-element hash) into the matmuls around it, and such kernels took longer to compile.
None is left. With q, k and v kept apart ([Note: one kernel for q, k and v], below) and the loop's
later changes, the fences' compile time no longer showed, and their memory traffic cost every
step (libtpu 0.0.21 deviceless, PROJECTED, 2026-12-01, the host in its fast phase, interleaved
one job at a time; bench/results/scan_compile_2026-12-01.json):
- 2B GPT-2 for v4-8 (the scan config, resid and embedding dropout 0.1): without the dropout and
  attention-output fences AdamW 2.428 -> 2.411 s, Adafactor 2.425 -> 2.407 s, libtpu compile
  17.9 -> 18.2 s and 18.8 -> 19.2 s. Either kind alone gained nothing (2.428 and 2.431 s): the
  output projection, its bias, the residual's dropout and the residual add fuse only when
  neither is fenced.
- Llama 3 8B for v6e-256 without the attention-input fence: 3.439 -> 3.430 s, compile 27.6 ->
  27.8 s.
- The 64B for v4-256: 17.709 -> 17.688 s. The GSPMD engine's scanned 2B: the same program.

Anywhere but a scanned layer's body traced on XLA, `apart` is nothing (`_active`).
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
    """Whether `t` is being traced for a scanned layer on XLA, where `apart` applies."""
    return in_scanned_layer() and t.device.type == "xla"


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

    A slice of a weight, written as a tensor of its own in the forward and its gradient written
    on its own before it joins the weight's gradient, when traced for a scanned layer on XLA;
    else `t`. GPT-2 keeps q, k and v in one weight (c_attn). Sliced inside their matmuls, the
    three projections are three kernels that differ only in the slice's offset, and libtpu
    compiles each (about 3 s apiece for the 2B on this host), in the forward, for the input's
    gradient and for the weight's. libtpu compiles a kernel once when another in the program
    is the same computation on operands of the same shapes and layouts; with the slices apart
    the three are the same kernel in each of the three places. The cost is a copy of each slice
    and of each slice's gradient (a [3072, 24, 128] bf16 tensor for the 2B). Measured 2026-12-01
    (PROJECTED, interleaved): without it the 2B for v4-8 compiles in 20.9 s instead of 17.2 s for
    2 ms less step; the 64B for v4-256, whose slices are far larger beside its 8 x 1024 tokens a
    chip, pays 0.167 s of a 17.7 s step for it (docs/scan.md, "The blog's 64B on v4-256")."""
    return _Apart.apply(t) if _active(t) else t
