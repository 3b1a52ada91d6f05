"""Tied embeddings that `Module.to(xla)` untied, found when a model is wrapped.

[Note: ties lost on the way to the device] On torch_xla 2.9 `Module.to(xla_device)` gives every module its own new
Parameter (XLA tensors cannot take a CPU tensor's storage in place), so a weight registered in two modules becomes two
weights: a Hugging Face model's `lm_head.weight` is no longer `wte.weight` (checked on XLA:CPU with GPT-2; transformers'
Trainer re-ties after its own `.to()` for this reason). Trained that way, the output projection and the embedding learn
apart, from equal values: the first loss is the same, every gradient of the embedding after it is not (the embedding's
misses the head's part), a silent difference from the same script on a GPU.

Wrapping moves a CPU model itself and keeps its ties. For a model moved before wrapping whose config says its embeddings
are tied (`config.tie_word_embeddings`), the wrapper re-ties them with the model's own `tie_weights()` when the two
weights are still equal, with a warning, and refuses them when they differ (trained apart: which one to keep is the
user's call)."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn


def _weights(module: nn.Module):
    config = getattr(module, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return None
    get_in, get_out = getattr(module, "get_input_embeddings", None), getattr(module, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out) and callable(getattr(module, "tie_weights", None))):
        return None
    try:
        inp, out = get_in(), get_out()
    except (NotImplementedError, AttributeError):
        return None
    a, b = getattr(inp, "weight", None), getattr(out, "weight", None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a is b:
        return None
    if a.device.type != "xla" or b.device.type != "xla" or a.shape != b.shape:
        return None
    return a, b


def retie(module: nn.Module) -> None:
    """Re-tie `module`'s input and output embeddings if moving it to the XLA device untied them
    ([Note: ties lost on the way to the device]); an error if they were trained apart."""
    pair = _weights(module)
    if pair is None:
        return
    a, b = pair
    name = type(module).__name__
    with torch.no_grad():
        same = a.dtype == b.dtype and bool(torch.equal(a, b))
    if not same:
        raise ValueError(
            f"{name}'s config ties its input and output embeddings (tie_word_embeddings=True), but they are two "
            "different weights on the XLA device with different values: Module.to() on torch_xla gives each module "
            "its own copy of a shared weight, and these were trained apart. Wrap the model before moving it (the "
            "wrapper moves it and keeps the tie), call model.tie_weights() right after .to(), or set "
            "config.tie_word_embeddings=False if they are meant to be separate")
    module.tie_weights()
    warnings.warn(
        f"{name}: its input and output embeddings were untied by Module.to() on torch_xla (each module got its own "
        "copy); re-tied with model.tie_weights() before sharding, as its config says. Wrap the model before moving "
        "it, or call model.tie_weights() after .to(), to keep the tie yourself", stacklevel=3)
