"""The Pallas flash-attention kernel in interpret mode on CPU tensors: the numerics of the TPU kernel, forward and
backward, where no TPU is (tests compare it with eager attention).

The same jax kernels torch_xla calls (`jax.experimental.pallas.ops.tpu.flash_attention`: the forward, and the dq / dkv
backward kernels through its custom VJP), at torch_xla's block sizes, run by Pallas's TPU interpreter; values cross
between torch and jax through numpy.
"""
from __future__ import annotations

import os

import torch

from xla_fsdp.attention.rules import SEQUENCE_BLOCKS

BLOCK_B = 2  # torch_xla's FlashAttention.DEFAULT_BLOCK_SIZES["block_b"]


def _jax():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    return jax, jnp, pltpu, fa


def _to_jax(t: torch.Tensor):
    _, jnp, _, _ = _jax()
    dtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[t.dtype]
    return jnp.asarray(t.detach().float().cpu().numpy()).astype(dtype)


def _to_torch(a, like: torch.Tensor) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.array(a, dtype=np.float32)).to(dtype=like.dtype, device=like.device)


class _Interpreted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        jax, _, pltpu, fa = _jax()
        sizes = fa.BlockSizes(block_b=min(BLOCK_B, q.shape[0]),
                              **{name: min(block, q.shape[2]) for name, block in SEQUENCE_BLOCKS.items()})

        def kernel(q, k, v):
            return fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes)

        with pltpu.force_tpu_interpret_mode():
            out, ctx.vjp = jax.vjp(kernel, _to_jax(q), _to_jax(k), _to_jax(v))
        ctx.like = (q, k, v)
        return _to_torch(out, q)

    @staticmethod
    def backward(ctx, grad):
        _, _, pltpu, _ = _jax()
        with pltpu.force_tpu_interpret_mode():
            grads = ctx.vjp(_to_jax(grad.contiguous()))
        return (*(_to_torch(g, t) for g, t in zip(grads, ctx.like)), None, None)


def flash_attention_interpreted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                                scale: float) -> torch.Tensor:
    """[batch, heads, seq, head_dim] attention through the interpreted Pallas kernel, differentiable."""
    return _Interpreted.apply(q, k, v, causal, scale)
