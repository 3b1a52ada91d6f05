"""GPT-2's learned position embeddings read as a slice where transformers reads 0, 1, ..., T-1.

[Note: position embeddings as a slice] Called without `position_ids` and without a cache, transformers' `GPT2Model`
builds the positions `arange(T)[None]` and looks them up in `wpe` as it looks up tokens: a gather, whose gradient is a
scatter-add of the [batch, T, hidden] gradient into the [n_positions, hidden] table. On a TPU that scatter is a kernel
libtpu is slow to compile (about 4 s, the largest single kernel of the scanned 2B GPT-2's step). The rows it reads are
the table's first T rows in order, so here the lookup is `wpe.weight[:T][None]`: the same values, and its gradient is
the batch's sum written into the first T rows (a reduction and a pad, no scatter).

Only that call takes the slice: `GPT2Model.forward` called with neither `position_ids` nor `past_key_values` (the
training step; a cache, even an empty one, or explicit positions run transformers' own lookup), checked on the bound
arguments; a lookup whose positions are not the [1, T] row transformers builds there falls back to the gather."""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from xla_fsdp.class_swap import mix_into

_FLAG = "_xla_fsdp_positions_in_order"


class SlicedPositions:
    """Mixed into the `nn.Embedding` `GPT2Model.wpe` by `use_sliced_positions`."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        steps = positions.shape[-1] if positions.dim() == 2 else None
        if steps is not None and getattr(self, _FLAG, False) and positions.shape[0] == 1 \
                and steps <= self.weight.shape[0] and self.max_norm is None:
            return self.weight[:steps].unsqueeze(0)
        return F.embedding(positions, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


def _before(model: nn.Module, args, kwargs):
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError:
        return None  # transformers' own call will say what is wrong
    given = bound.arguments
    in_order = given.get("position_ids") is None and given.get("past_key_values") is None
    setattr(model.wpe, _FLAG, in_order)
    return None


def _after(model: nn.Module, args, kwargs, output):
    setattr(model.wpe, _FLAG, False)
    return None


def use_sliced_positions(model: nn.Module) -> int:
    """Give every transformers `GPT2Model` in `model` the sliced position lookup (before or after wrapping: the
    embedding's class changes, not its parameter); returns how many."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model

    count = 0
    for module in model.modules():
        if isinstance(module, GPT2Model) and isinstance(module.wpe, nn.Embedding) \
                and not isinstance(module.wpe, SlicedPositions):
            mix_into(module.wpe, SlicedPositions, "Sliced")
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True, always_call=True)  # also when forward raises
            count += 1
    return count
