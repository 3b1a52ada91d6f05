"""Logits padded to a round vocabulary, exactly: `pad_vocabulary(model, multiple=128)`.

[Note: padded vocabulary]
GPT-2's vocabulary has 50,257 entries (29 x 1733): every [tokens, vocab] tensor of the
output layer and the loss has a minor dimension that no TPU tile divides. libtpu's code
generation pays for it: the 2B GPT-2 step for v4-8 (GSPMD engine, scan_layers, AdamW)
compiled in 93.1 s with 50,257 and in 31.2 s with a model of 50,304 entries (measured with
`python -m xla_fsdp.aot`, libtpu 0.0.21, 2026-11-28; the same model with a 512-entry
vocabulary: 41.0 s). nanoGPT and Megatron pad the vocabulary for this reason, which changes
the model: the extra tokens get logits and take part in every softmax.

Here the parameters are not touched. The output layer's logits get `multiple`-rounding
extra columns of -inf after the projection: softmax gives them probability 0 exactly, the
loss, its gradient and every parameter's gradient are those of the unpadded model (the
padded columns' gradient is 0 and the pad's backward drops it), and argmax / sampling never
picks them. What changes is the logits' last dimension (50,304 for GPT-2): a transformers
model's own loss reshapes logits to `config.vocab_size`, so its `loss_function` is given the
padded width; other code that checks the width against the config sees the difference (an
error, not a different result). The embedding, the state dict and saved models keep the
model's own vocabulary. run_clm pads to 128 by default (`--pad_vocab_multiple 0`: off).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def padded_size(vocab: int, multiple: int) -> int:
    """`vocab` rounded up to a multiple of `multiple`."""
    if multiple <= 0:
        raise ValueError(f"multiple={multiple}: pass a positive multiple (128 suits TPU tiles)")
    return math.ceil(vocab / multiple) * multiple


def pad_vocabulary(model: nn.Module, multiple: int = 128) -> int:
    """Pads the logits of `model`'s output layer (`get_output_embeddings()`, a Linear) with
    -inf columns up to a multiple of `multiple` ([Note: padded vocabulary]); returns the
    padded width (the vocabulary itself when it already divides). Call before or after
    wrapping; once per model."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"pad_vocabulary needs a model whose get_output_embeddings() is an nn.Linear "
                        f"(a transformers causal LM); {type(model).__name__} gives {type(head).__name__}")
    if getattr(head, "_xla_fsdp_padded_vocab", None) is not None:
        raise ValueError(f"{type(model).__name__}'s logits are already padded to "
                         f"{head._xla_fsdp_padded_vocab}; call pad_vocabulary once")
    vocab = head.out_features
    width = padded_size(vocab, multiple)
    head._xla_fsdp_padded_vocab = width
    if width == vocab:
        return width

    def pad(module: nn.Module, args, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != vocab:  # not this head's projection: leave it
            return logits
        return F.pad(logits, (0, width - vocab), value=float("-inf"))

    head.register_forward_hook(pad)
    loss = getattr(type(model), "loss_function", None)
    if isinstance(loss, property):  # transformers: its loss reshapes logits to config.vocab_size
        original = model.loss_function

        def padded_loss(logits, labels, vocab_size=None, **kwargs):
            if vocab_size == vocab and logits.shape[-1] == width:
                vocab_size = width
            return original(logits, labels, vocab_size=vocab_size, **kwargs)

        model.loss_function = padded_loss
    return width
