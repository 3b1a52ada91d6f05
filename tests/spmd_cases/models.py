"""Tiny models, batches and training loops shared by the SPMD case scripts.

Imported only inside subprocesses that already selected SPMD mode.
"""

from __future__ import annotations

import copy
import functools
from typing import List, Tuple

import torch
import torch.nn as nn

LR = 1e-2


class Block(nn.Module):
    """Linear + GELU: the MLP's wrap unit."""

    def __init__(self, d_in: int, d_out: int, device=None):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, device=device)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


class TinyMLP(nn.Module):
    """Dims 10, 7, 3 and 5: none divides 4 or 8, so every shard is padded."""

    def __init__(self, device=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block(6, 10, device), Block(10, 7, device), Block(7, 3, device)])
        self.head = nn.Linear(3, 5, device=device)
        self.scale = nn.Parameter(torch.ones((), device=device))
        # A floating buffer, for buffer_dtype (zeros: no effect on the loss).
        self.register_buffer("offset", torch.zeros(5, device=device))

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        out = self.head(x) * self.scale + self.offset
        return torch.nn.functional.mse_loss(out.float(), target)


def build_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyMLP()


def mlp_batches(steps: int, batch: int = 8) -> List[Tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=gen), torch.randn(batch, 5, generator=gen)) for _ in range(steps)]


def mlp_policy():
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def build_gpt2(seed: int = 0, vocab: int = 128, layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64,
        n_layer=layers,
        n_head=2,
        vocab_size=vocab,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def gpt2_batches(steps: int, batch: int = 8, seq: int = 16, vocab: int = 128) -> List[Tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append((ids, ids.clone()))
    return out


def gpt2_policy():
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={"GPT2Block"})


def loss_of(model: nn.Module, kind: str, batch) -> torch.Tensor:
    if kind == "mlp":
        return model(batch[0], batch[1])
    return model(input_ids=batch[0], labels=batch[1]).loss


def train_eager(model: nn.Module, kind: str, batches) -> List[float]:
    """The unsharded reference: torch eager on the host CPU, fp32."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_of(model, kind, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
