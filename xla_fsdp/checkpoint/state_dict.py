"""Saving and loading a sharded model.

Two formats, as PyTorch FSDP users expect:
- full: the unwrapped model's `state_dict()` (same keys, full shapes, CPU tensors), gathered from the shards. Every rank
  must call it (it gathers); with `rank0_only=True` only sharding rank 0 gets the tensors. Loads into any layout and
  into the unwrapped model.
- sharded: each rank's own shards plus a record of the layout they belong to, for fast intermediate checkpoints. Loads
  only into the same layout; anything else is refused before a single tensor is written."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

from ..collective_engine import model_state as keys
from ..collective_engine.model_state import check_load, records as _records, unit_states
from ..collective_engine.sharded_param import stored_shape
from ..runtime import stored_keys
from ..unit_state import state_of

SHARDED_FORMAT = "xla_fsdp.sharded/1"


def _buffers(model: nn.Module, persistent_only: bool = True) -> Dict[str, torch.Tensor]:
    """Host copies of the buffers by state-dict key: those of `model.state_dict()` (the full format), or all of them
    (the sharded format, which resumes the run: non-persistent ones too)."""
    return {name: b.detach().cpu().clone() for name, b in keys.buffers(model, persistent_only).items()}


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """The unwrapped model's state dict (full parameters, fp32, on CPU). Call on every rank."""
    layout = state_of(model).group.comm.layout
    keep = not rank0_only or layout.shard_rank == 0
    # every key checked on every rank before the first gather (all raise, or none)
    names_of = {id(rec): names for names, rec, _ in _records(model)}
    with stored_keys.stored_keys():  # scan_layers' stored stacks under their own names, split at the end
        order = list(model.state_dict().keys())
    out: Dict[str, torch.Tensor] = {}
    for unit_state in unit_states(model):
        group = unit_state.group
        full = group.full_params()
        group.comm.sync(full)
        if keep:
            for rec, tensor in zip(group.params, full):
                cpu = tensor.detach().cpu().clone()
                for name in names_of[id(rec)]:
                    out[name] = cpu
    if keep:
        out.update(_buffers(model))
        return stored_keys.per_layer(model, {k: out[k] for k in order})
    return {}


def load_full_state_dict(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load a full (unwrapped-model) state dict into the shards of this rank."""
    state = stored_keys.stacked(model, state)  # per-layer keys into scan_layers' stored stacks
    records = _records(model)
    expected = {name: [rec.orig_shape] for names, rec, _ in records for name in names}
    buffers = keys.buffers(model)
    expected.update({n: [b.shape] for n, b in buffers.items()})
    check_load("full state dict", {k: v.shape for k, v in state.items()}, expected)
    with torch.no_grad():
        for names, rec, group in records:
            rec.load_full(state[names[0]], group.comm)
        for name, b in buffers.items():
            b.copy_(state[name].to(b.dtype).to(b.device))


def _layout(model: nn.Module) -> Dict:
    """The layout record of a sharded state dict; all but "rank" must match to load it."""
    layout = state_of(model).group.comm.layout
    return {"world_size": layout.world_size, "shard_world_size": layout.shard_world_size,
            "shard_rank": layout.shard_rank, "rank": layout.rank,
            "shard_groups": [list(g) for g in layout.shard_groups]}


def sharded_state_dict(model: nn.Module) -> Dict:
    """This rank's shards and the layout they belong to (CPU tensors)."""
    records = _records(model)
    return {
        "format": SHARDED_FORMAT,
        "layout": _layout(model),
        "shapes": {names[0]: list(rec.orig_shape) for names, rec, _ in records},
        "params": {names[0]: rec.sharded.detach().cpu().clone() for names, rec, _ in records},
        "buffers": _buffers(model, persistent_only=False),
    }


def load_sharded_state_dict(model: nn.Module, state: Dict) -> None:
    """Load this rank's shards saved by `sharded_state_dict` under the same layout."""
    if not isinstance(state, dict) or state.get("format") != SHARDED_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an xla_fsdp sharded checkpoint (format {got!r}, expected {SHARDED_FORMAT!r}); for a "
                         "full state dict use load_full_state_dict")
    records = _records(model)
    saved = state["layout"]
    for key, value in _layout(model).items():
        if key != "rank" and saved.get(key) != value:
            raise ValueError(
                f"sharded checkpoint is from another layout: it was saved with {key}={saved.get(key)}, this model "
                f"has {key}={value}. Load it with the same world size and sharding groups, or consolidate it "
                "with full_state_dict on the original layout and load that with load_full_state_dict")
    names = {names[0]: rec for names, rec, _ in records}
    buffers = keys.buffers(model, persistent_only=False)
    check_load("sharded checkpoint", dict(state["shapes"]),
               {name: [rec.orig_shape] for name, rec in names.items()})
    check_load("sharded checkpoint shards", {k: v.shape for k, v in state["params"].items()},
               {name: [stored_shape(rec.sharded)] for name, rec in names.items()})
    check_load("sharded checkpoint buffers", {k: v.shape for k, v in state["buffers"].items()},
               {n: [b.shape] for n, b in buffers.items()})
    with torch.no_grad():
        comm = state_of(model).group.comm
        for name, rec in names.items():
            rec.load_shard(state["params"][name], comm)
        for name, b in buffers.items():
            b.copy_(state["buffers"][name].to(b.dtype).to(b.device))
