"""The small models the parity tests train and the HLO traces build (tests/, bench/comm_volume.py,
bench/common/hlo_trace_worker.py), with their batches and losses.

"mlp", "mlp_nested" and "mlp_mixed" are MLPs whose row counts leave padding on every rank at
worlds 2 and 4 ("mlp_tiles" one whose large shards at 8 devices are whole TPU tiles); "gpt2"
is a tiny GPT-2 (d 64, 2 layers, vocab 128), "gpt2_small" a small one (d 256, 4 layers, vocab
8192). Every model is built from a seed, every batch from its step.
"""
from __future__ import annotations

import torch
import torch.nn as nn

GLOBAL_BATCH = 8


def gpt2_config(size: str = "tiny"):
    from transformers import GPT2Config

    dims = {"tiny": dict(n_embd=64, n_layer=2, n_head=2, vocab_size=128),
            "small": dict(n_embd=256, n_layer=4, n_head=4, vocab_size=8192)}[size]
    return GPT2Config(n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **dims)


def build_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp_mixed":
        # two weights above the small-parameter bucket's 16384 elements (521 rows: padding too)
        return nn.Sequential(nn.Linear(32, 521), nn.GELU(), nn.Sequential(nn.Linear(521, 67), nn.Tanh()),
                             nn.Linear(67, 5))
    if kind == "mlp_tiles":
        # two weights above the bucket's 16384 elements whose shards at 8 devices are whole (8, 128)
        # tiles of fp32 ([32, 128] and [16, 256]): gathered in their own shape by rings
        return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128),
                             nn.GELU(), nn.Linear(128, 5))
    if kind in ("mlp", "mlp_nested"):
        # 67 rows do not divide by 2 or 4: every rank holds padding somewhere
        return nn.Sequential(nn.Linear(32, 67), nn.GELU(), nn.Sequential(nn.Linear(67, 67), nn.Tanh()),
                             nn.Linear(67, 5))
    if kind in ("gpt2", "gpt2_small"):
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(gpt2_config("small" if kind == "gpt2_small" else "tiny"))
    raise ValueError(kind)


def batch(kind: str, step: int, size: int = GLOBAL_BATCH):
    gen = torch.Generator().manual_seed(1000 + step)
    if kind.startswith("mlp"):
        return torch.randn(size, 32, generator=gen), torch.randn(size, 5, generator=gen)
    ids = torch.randint(0, 128, (size, 16), generator=gen)
    return ids, ids


def loss_fn(kind: str, model: nn.Module, x, y) -> torch.Tensor:
    if kind.startswith("mlp"):
        return ((model(x).float() - y) ** 2).mean()
    return model(input_ids=x, labels=y).loss.float()

