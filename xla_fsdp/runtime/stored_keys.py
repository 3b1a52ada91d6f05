"""Which names a model's `state_dict()` gives to parameters stored stacked (scan_layers).

A model whose repeated layers are scanned stores each of their parameters once, stacked
([Note: parameters stored stacked] in layer_scan/gspmd/stacked.py; the collectives engine's in
layer_scan/collective/stacked_units.py). Its `state_dict()` names every layer's slice as the unscanned model does
(`h.3.attn.c_attn.weight`), which is what Hugging Face, torch and a plain model load. The sharded checkpoints
(xla_fsdp.checkpoint) store what the model holds instead: the stacked tensors, under their own names, sharded on dim 0.
They ask for those names inside `stored_keys()`."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, Iterator

import torch
import torch.nn as nn

_local = threading.local()


@contextmanager
def stored_keys() -> Iterator[None]:
    """Within this block, `state_dict()` names stacked parameters as the model holds them."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def wanted() -> bool:
    """Whether the caller asked for the stored names (`stored_keys()`)."""
    return getattr(_local, "on", False)


def layer_slice(stored: torch.Tensor, index: int) -> torch.Tensor:
    """Layer `index`'s parameter out of its stored stack ((d0, L, *rest), or (L,) for a scalar)."""
    return stored.select(1, index) if stored.dim() > 1 else stored[index]


def stack_layers(tensors) -> torch.Tensor:
    """Layers' tensors -> their stored stack (the inverse of `layer_slice`)."""
    tensors = list(tensors)
    return torch.stack(tensors, dim=1 if tensors[0].dim() > 0 else 0)


def split(records, state: Dict[str, torch.Tensor], prefix: str) -> None:
    """Rewrites `state` (keys under `prefix`, the owner's) in place: each stored stack of `records`
    (layer_scan.stored_stacks.StackRecord) becomes its layers' keys, placed where the layers' own keys (their buffers)
    or the stack were, in the unscanned model's order."""
    for record in records:
        listed, stored = f"{prefix}{record.attr}.", f"{prefix}{record.store}."
        old = dict(state)
        state.clear()
        done = False
        for key, value in old.items():
            if not key.startswith((listed, stored)):
                state[key] = value
            elif not done:
                done = True
                for i in range(record.layers):
                    for local in record.order:
                        name = f"{listed}{i}.{local}"
                        if local in record.names:
                            value = layer_slice(old[stored + local], i)
                            # host tensors as tensors of their own: save_pretrained views each as flat (a strided
                            # column of the stack cannot be); device tensors stay views (no copy on the device)
                            state[name] = value.contiguous() if value.device.type == "cpu" else value
                        elif name in old:
                            state[name] = old[name]


def per_layer(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A state dict keyed as the model holds it (stored stacks) -> keyed per layer, as `model.state_dict()` gives it;
    unchanged for a model without stored stacks."""
    out = dict(state)
    for name, module in model.named_modules():
        records = module.__dict__.get("_xla_fsdp_stacks")
        if records:
            split(records, out, f"{name}." if name else "")
    return out


def stacked(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The inverse of `per_layer`: a state dict keyed per layer -> keyed as the model holds it (each stored stack from
    its layers' tensors, stacked as `stack_layers` does); keys of a layer set that is not complete are left as they are
    (the caller's key check names them)."""
    out = dict(state)
    for stored, layers in stack_table(model).items():
        if all(k in out for k in layers):
            out[stored] = stack_layers([out.pop(k) for k in layers])
    return out


def stack_table(model: nn.Module) -> Dict[str, list]:
    """Each stored stack's key -> its layers' keys (a checkpoint records it: consolidation writes the layers' tensors,
    as `model.state_dict()` names them)."""
    out: Dict[str, list] = {}
    for owner_name, module in model.named_modules():
        prefix = f"{owner_name}." if owner_name else ""
        for record in module.__dict__.get("_xla_fsdp_stacks", ()):
            for name in record.names:
                out[f"{prefix}{record.store}.{name}"] = [f"{prefix}{record.attr}.{i}.{name}"
                                                         for i in range(record.layers)]
    return out
