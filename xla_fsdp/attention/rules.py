"""What the Pallas flash-attention kernel can take, checked before it is traced.

Each rule comes from torch_xla 2.9's glue (`FlashAttention.DEFAULT_BLOCK_SIZES` in
torch_xla/experimental/custom_kernel.py) or from libtpu 0.0.21's deviceless compile of the kernel (docs/attention.md);
the errors say which setting to change.
"""
from __future__ import annotations

from typing import Optional, Tuple

# torch_xla 2.9's block sizes along the sequence (FlashAttention.DEFAULT_BLOCK_SIZES, all but block_b);
# tests/test_attention_kernel.py checks they are still torch_xla's
SEQUENCE_BLOCKS = {"block_q": 512, "block_k_major": 512, "block_k": 512, "block_q_major_dkv": 512,
                   "block_k_major_dkv": 512, "block_q_dkv": 512, "block_k_dkv": 512, "block_q_dq": 1024,
                   "block_k_dq": 256, "block_k_major_dq": 512}
MIN_SEQUENCE = 128  # FlashAttention.MIN_BLOCK_SIZE: the residuals' lane width
# Compiled for v4-8 at sequence 1024: head dim 256 compiles, 512 overflows the dq kernel's on-chip vector memory
# (docs/attention.md)
MAX_HEAD_DIM = 256
# dropout settings by model type: the kernel has no attention dropout
DROPOUT_SETTINGS = ("attn_pdrop", "attention_dropout")


class KernelInputError(ValueError):
    """Input the Pallas kernel cannot take; the message names the setting to change."""


def sequence_problem(seq_len: int) -> Optional[str]:
    """Why the kernel cannot take sequences of `seq_len` tokens (None: it can). Every block min(block, seq_len) must
    divide the sequence, so 128, 256, 512 and multiples of 1024 pass."""
    if seq_len < MIN_SEQUENCE or seq_len % MIN_SEQUENCE:
        return f"it must be a multiple of {MIN_SEQUENCE}"
    for name, block in SEQUENCE_BLOCKS.items():
        if seq_len % min(block, seq_len):
            return f"torch_xla's {name}={block} does not divide it (the kernel takes 128, 256, 512 or a multiple of 1024)"
    return None


def check_shapes(query_shape: Tuple[int, ...], key_shape: Tuple[int, ...]) -> None:
    """Refuse [batch, heads, seq, head_dim] shapes the kernel cannot take, naming the setting."""
    *_, q_len, head_dim = query_shape
    k_len = key_shape[-2]
    if q_len != k_len:
        raise KernelInputError(f"the Pallas attention kernel takes queries and keys of one length "
                               f"(got {q_len} and {k_len}): it trains, it does not decode with a cache; "
                               "use --attn_implementation eager for generation")
    problem = sequence_problem(q_len)
    if problem:
        raise KernelInputError(f"the Pallas attention kernel cannot take sequence length {q_len}: {problem}; "
                               "set --block_size to one it takes (e.g. 1024), or use --attn_implementation eager")
    if head_dim > MAX_HEAD_DIM:
        raise KernelInputError(f"the Pallas attention kernel cannot take head dim {head_dim} (at most "
                               f"{MAX_HEAD_DIM}: larger blocks overflow the TPU's vector memory); give the "
                               "model more heads (n_head) or use --attn_implementation eager")


def check_config(config, source: str = "the model config") -> None:
    """Refuse a config the kernel cannot train: attention dropout above 0 (the first of DROPOUT_SETTINGS it has)."""
    name = next((n for n in DROPOUT_SETTINGS if hasattr(config, n)), None)
    value = float(getattr(config, name) or 0.0) if name is not None else 0.0
    if value > 0:
        raise KernelInputError(f"{source} sets {name}={value:g}, but the Pallas attention kernel has no "
                               f"attention dropout; set {name} to 0 (configs/models/gpt2-2b-nodropout.json "
                               "is the 2B recipe so), or use --attn_implementation eager")
