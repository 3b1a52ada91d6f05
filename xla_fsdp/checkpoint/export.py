"""`save_pretrained`: the trained model as a Hugging Face directory, written from the running job.

The full parameters are gathered to rank 0 (one unit at a time; rank 0 holds the whole model once, as Hugging Face's own
save does), tied weights are stored once under their first name, and the config is the model's own, so `from_pretrained`
loads the directory. For models too large for one host use a sharded checkpoint and the offline `consolidate`, which
streams. `out_dir` may be a local (or mounted) path or an fsspec URL (storage.py)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

from . import format as fmt
from ..runtime import hosts, stored_keys
from ..collective_engine import model_state as keys
from ..unit_state import units
from .holdings import holdings, process_info, spmd_runtime
from .state_dict import full_state_dict


def full_model_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unwrapped model's state dict on the host, tied weights as one tensor (rank 0; {} on the others). Collective
    for the collective engine and for SPMD hosts: every process calls it."""
    if spmd_runtime(model) and process_info(model).world > 1:
        return stored_keys.per_layer(model, _gathered_over_hosts(model))  # scan_layers' stacks per layer
    if units(model):
        return full_state_dict(model, rank0_only=True)
    host: Dict[int, torch.Tensor] = {}
    return {k: host.setdefault(id(v), v.detach().cpu()) for k, v in model.state_dict(keep_vars=True).items()}


def _gathered_over_hosts(model: nn.Module) -> Dict[str, torch.Tensor]:
    """SPMD on several hosts: no host can read another host's chips, so each sends the rows it would write to a
    checkpoint (host_shards.py: every row once) to the first host over the hosts' group, one parameter at a time; the
    first host assembles them."""
    group = hosts.host_group()
    out: Dict[str, torch.Tensor] = {}
    for h in holdings(model):
        mine = [(a, b, produce()) for a, b, produce in h.pieces(h.param)]
        parts = group.gather(mine)
        if group.rank != 0:
            continue
        full = torch.empty((h.num_rows, *h.row_shape), dtype=h.param.dtype)
        filled = 0
        for part in parts:
            for a, b, rows in part:
                full[a:b] = rows
                filled += b - a
        if filled != h.num_rows:
            raise RuntimeError(f"{h.name}: the hosts sent {filled} of {h.num_rows} rows")
        out.update(dict.fromkeys((h.name, *h.aliases), full.reshape(h.full_shape)))
    if group.rank == 0:  # buffers stay replicated: every host holds them whole
        out.update({name: b.detach().cpu() for name, b in keys.buffers(model, persistent_only=True).items()})
    return out


def save_pretrained(model: nn.Module, out_dir: str) -> None:
    """Write `config.json` (when the model has a Hugging Face config) and `model.safetensors`. Call on every process
    (the gathers are collective); rank 0 writes."""
    info = process_info(model)
    held = holdings(model)
    state = full_model_state(model)
    if info.rank == 0:
        aliases = {alias for h in held for alias in h.aliases}
        tensors: Dict[str, torch.Tensor] = {k: v.contiguous() for k, v in state.items() if k not in aliases}
        entries = [(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()]
        to_json = getattr(getattr(model, "config", None), "to_json_string", None)  # what config.to_json_file writes
        fmt.write_pretrained(out_dir, entries, to_json().encode() if to_json else None)
    info.barrier()
