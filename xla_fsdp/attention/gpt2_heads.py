"""GPT-2's attention projections written head-major around the Pallas kernel.

[Note: head-major projections]
The kernel takes queries, keys and values as [batch, heads, seq, head_dim] and returns its output in that layout.
transformers' GPT-2 computes them as one [batch, seq, 3 x hidden] matmul, splits, views and transposes them into
the kernel's layout, and transposes the output back and flattens it for the output projection. On the TPU each of
those is a copy of an activation-sized tensor in the forward, the recompute and the backward (measured: about 190
ms of a 2.5 s 2B step; docs/performance.md, "Fused attention"). Here the same weights are read as [hidden, 3,
heads, head_dim] and [heads, head_dim, hidden] and the projections are einsums that produce and consume the
head-major layout directly, so the compiler can write each matmul's result where the kernel reads it. Same
parameters, same state dict, same arithmetic (tests/test_attention_kernel.py checks it against eager attention in
interpret mode). Only self-attention in training shape takes this path; anything else (cross-attention, GPT-2's
reordered upcast attention) runs transformers' own forward. run_clm uses it where the model sees per-device
tensors (one process per chip, the collective engine on the single controller), not under the GSPMD engine: there
the kernel's operands come out of the partitioner with a sharding torch_xla's custom-call handler refuses ("Check
failed: ShapeUtil::Compatible(...)"), though torch_xla's FSDPv2 (bench/anchor_job.py) compiles with it.
"""
from __future__ import annotations

import torch

from xla_fsdp.attention.rules import check_shapes
from xla_fsdp.memory.saved_outputs import as_output_of
from xla_fsdp.layer_scan.fences import apart


class HeadMajorGPT2Attention:
    """Mixed into a transformers `GPT2Attention` instance by `use_head_major`."""

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, **kwargs):
        from xla_fsdp.attention import kernel

        if (encoder_hidden_states is not None or self.is_cross_attention or self.reorder_and_upcast_attn
                or self.config._attn_implementation != kernel.NAME):
            return super().forward(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                                   encoder_hidden_states=encoder_hidden_states,
                                   encoder_attention_mask=encoder_attention_mask,
                                   output_attentions=output_attentions, **kwargs)
        kernel.refuse_unsupported(self.attn_dropout.p if self.training else 0.0, attention_mask)
        heads, head_dim = self.num_heads, self.head_dim
        hidden = self.c_attn.weight.shape[0]
        weight = self.c_attn.weight.view(hidden, 3, heads, head_dim)  # Conv1D: [in, out]
        bias = self.c_attn.bias.view(3, heads, 1, head_dim)
        # a bias in another dtype than the matmul (FSDPv1 keeps them f32 beside bf16 weights) joins in the
        # matmul's dtype, as Conv1D's addmm does on XLA
        # [Note: one kernel for q, k and v]
        query, key, value = (as_output_of(self.c_attn, (hidden_states,), _plus(  # a policy may save each
            torch.einsum("bsi,ihd->bhsd", hidden_states, apart(weight[:, i])), bias[i])) for i in range(3))
        if past_key_values is not None:  # as transformers' forward: the cache sees [b, h, s, d] keys/values
            cache = getattr(past_key_values, "self_attention_cache", past_key_values)
            key, value = cache.update(key, value, self.layer_idx)
        check_shapes(tuple(query.shape), tuple(key.shape))
        out = kernel.head_major_attention(query, key, value, causal=True, scale=float(self.scaling))
        proj = self.c_proj.weight.view(heads, head_dim, self.c_proj.weight.shape[1])
        attn_output = as_output_of(self.c_proj, (out,), _plus(torch.einsum("bhsd,hde->bse", out, proj), self.c_proj.bias))
        return self.resid_dropout(attn_output), None


def _plus(product: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return product + bias.to(product.dtype)


def use_head_major(model: torch.nn.Module) -> int:
    """Give each self-attention `GPT2Attention` in `model` the head-major forward (only its class changes); how many."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    from xla_fsdp.attention.kernel import mix_head_major

    return mix_head_major(model, GPT2Attention, HeadMajorGPT2Attention, lambda m: not m.is_cross_attention)
