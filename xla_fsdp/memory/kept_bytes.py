"""What a checkpointed unit would hold from forward to backward if it kept its activations.

Autograd saves far more than a TPU program keeps: a GPT-2 block with transformers' `gelu_new` saves 30 bf16 values
per token and hidden unit, nearly all elementwise intermediates that libtpu recomputes inside the fusions that read
them; the TPU-compiled blocks held 6.4 to 7.3 (docs/performance.md). So only saved tensors made by work that is not
cheap to redo count: matmul and kernel outputs and the unit's input, found by the autograd node that made each
([Note: keep what fits] in fit.py scales them by SAVED_TO_KEPT).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

# autograd nodes (their op's name) that pass a tensor on unchanged in value (views, copies, casts, layouts): a
# saved tensor they made costs what the op before them costs
_PASS_ON = frozenset("View Reshape ReshapeAlias UnsafeView Transpose Permute Expand Squeeze Unsqueeze T Split "
                     "SplitWithSizes Slice Select Clone ToCopy Contiguous AsStrided Alias Narrow Unbind Unfold "
                     "UnsafeSplit Chunk".split())
# elementwise work and normalizations: the TPU compiler recomputes their outputs inside the fusions
# that read them, from what they read, so a kept unit holds none of them
_RECOMPUTED = frozenset("Add Sub Mul Div Neg Pow Sqrt Rsqrt Exp Log Tanh Sigmoid Gelu Silu Relu Softplus Where "
                        "Clamp Sin Cos Abs Erf Reciprocal Rsub Fill MaskedFill Maximum Minimum Addcmul Addcdiv "
                        "Lerp NativeLayerNorm NativeBatchNorm LayerNorm RmsNorm FusedRmsNorm Mean Sum Cat Stack".split())


def _op(fn) -> str:
    """An autograd node's op: "AddmmBackward0" -> "Addmm"."""
    name = type(fn).__name__.rstrip("0123456789")
    return name[:-len("Backward")] if name.endswith("Backward") else name


def _held(fn) -> bool:
    """Whether a kept unit holds what autograd node `fn` made (None: a leaf, the unit's input): not cheap to redo."""
    for _ in range(64):
        if fn is None:
            return True
        op = _op(fn)
        if op in _PASS_ON:
            nexts = [f for f, _ in fn.next_functions if f is not None]
            fn = nexts[0] if nexts else None
            continue
        return op not in _RECOMPUTED
    return True


@contextlib.contextmanager
def saved_bytes(module) -> Iterator[Dict[str, int]]:
    """What a unit would hold from forward to backward if it kept its activations: bytes of the tensors autograd
    saves inside the block that the TPU compiler keeps rather than recomputes (`_held`), each storage once (a view
    counts as its base); `module`'s own parameters as registered at the time (the gathered ones) left out.
    "autograd" is every saved byte."""
    import torch

    seen, stats, weights = set(), {"bytes": 0, "autograd": 0}, []

    def pack(t):
        base = t._base if t._base is not None else t
        if not weights:
            weights.append({id(v) for m in module.modules() for v in m._parameters.values() if v is not None})
        if id(base) not in seen and id(base) not in weights[0]:
            seen.add(id(base))
            size = base.numel() * base.element_size()
            stats["autograd"] += size
            if _held(t.grad_fn if t._base is None else base.grad_fn):
                stats["bytes"] += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield stats
