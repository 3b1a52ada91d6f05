"""Llama's attention projections written head-major around the Pallas kernel.

[Note: head-major Llama projections]
As for GPT-2 ([Note: head-major projections] in gpt2_heads.py): transformers' Llama computes q, k and v as [batch,
seq, heads x head_dim] matmuls, views and transposes them into the kernel's layout, and transposes the kernel's
output back for o_proj, each a copy of an activation in the forward, the recompute and the backward (measured: 5.4%
of the Llama 3 8B step's compute on v6e-256; docs/performance.md). Here q_proj, k_proj and v_proj's weights are read
as [heads, head_dim, hidden] and o_proj's as [hidden, heads, head_dim], and the projections are einsums that write
and read the kernel's layout directly. Same parameters, same state dict, same arithmetic (tests/test_attention_kernel.py
checks it against eager attention in interpret mode). Rotary embeddings apply to [batch, heads, seq, head_dim] as in
transformers. Grouped-query attention repeats each key/value head for its queries (`kernel.per_query_head`). A cache
is updated as transformers does (the kernel then refuses what it cannot take: a query shorter than the keys);
another attention implementation runs transformers' own forward.
"""
from __future__ import annotations

import torch

from xla_fsdp.attention.rules import check_shapes
from xla_fsdp.memory.saved_outputs import as_output_of


class HeadMajorLlamaAttention:
    """Mixed into a transformers `LlamaAttention` instance by `use_head_major`."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        from xla_fsdp.attention import kernel

        if position_embeddings is None or self.config._attn_implementation != kernel.NAME:
            return super().forward(hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        kernel.refuse_unsupported(self.attention_dropout if self.training else 0.0, attention_mask)
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        query = _heads(hidden_states, self.q_proj, heads, self.head_dim)
        key = _heads(hidden_states, self.k_proj, kv_heads, self.head_dim)
        value = _heads(hidden_states, self.v_proj, kv_heads, self.head_dim)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:  # as transformers' forward: the cache sees [b, h, s, d] keys/values
            key, value = past_key_values.update(key, value, self.layer_idx)
        key, value = kernel.per_query_head(query, key, value)
        check_shapes(tuple(query.shape), tuple(key.shape))
        out = kernel.head_major_attention(query, key, value, causal=True, scale=float(self.scaling))
        weight = self.o_proj.weight.view(self.o_proj.weight.shape[0], heads, self.head_dim)  # Linear: [out, in]
        attn_output = torch.einsum("bhsd,ehd->bse", out, weight)
        if self.o_proj.bias is not None:
            attn_output = attn_output + self.o_proj.bias.to(attn_output.dtype)
        return as_output_of(self.o_proj, (out,), attn_output), None


def _heads(hidden_states: torch.Tensor, proj: torch.nn.Linear, heads: int, head_dim: int) -> torch.Tensor:
    """proj(hidden_states) as [batch, heads, seq, head_dim], written in that layout."""
    weight = proj.weight.view(heads, head_dim, proj.weight.shape[1])  # Linear: [out, in]
    out = torch.einsum("bsi,hdi->bhsd", hidden_states, weight)
    if proj.bias is not None:
        out = out + proj.bias.view(heads, 1, head_dim).to(out.dtype)
    return as_output_of(proj, (hidden_states,), out)  # a recomputation policy may save it


def use_head_major(model: torch.nn.Module) -> int:
    """Give each `LlamaAttention` in `model` the head-major forward (only its class changes); how many."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from xla_fsdp.attention.kernel import mix_head_major

    return mix_head_major(model, LlamaAttention, HeadMajorLlamaAttention)
