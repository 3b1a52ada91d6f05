"""Loading a sharded checkpoint into a model (and optimizer) of any layout.

Everything is checked before anything is written: the checkpoint is complete, its parameters and optimizer match the
model's by name, shape and kind, and every file it needs is present and whole. Then each process reads the rows it holds
(for another layout: from whichever files hold them), and the optimizer gets a state dict in its own numbering.

`path` is a directory on a local or mounted file system or an fsspec URL (`gs://bucket/run/checkpoint-500`; storage.py);
at either, a directory without the COMPLETE marker is refused ([Note: commit without rename], save.py)."""
from __future__ import annotations

import contextlib
import io
import random
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from . import format as fmt
from . import restack as rs
from . import storage
from ..collective_engine import model_state as keys
from .format import CheckpointError
from ..collective_engine.optimizer_state import held_state_dict  # the padded global tensors, written row by row
from .holdings import Holding, holdings, layout_record, optimizer_names, process_info


def load_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    extra_state: Optional[Dict[str, Any]] = None, per_rank_state: str = "error") -> Dict[str, Any]:
    """Load the checkpoint at `path` into `model` (and `optimizer`); call on every process.

    Works for any layout on both sides (world size, sharding strategy, engine, runtime). `extra_state` objects with
    `load_state_dict` (an LR scheduler) are loaded in place; RNG states are restored. Returns {"step": ..., "extra":
    {name: saved value}}.

    Optimizer state that each rank computes over its own shard (Adafactor's column factor) has no exact value on another
    layout: loading it there is an error unless `per_rank_state="average"` (the mean over the saved ranks)."""
    st = storage.storage_for(path)
    path = st.abspath(path)
    if not fmt.is_complete(path):
        if not st.isdir(path):
            raise CheckpointError(f"no checkpoint directory at {path}")
        raise CheckpointError(f"{path} is not a complete checkpoint (no {fmt.COMPLETE} marker: the save did "
                              "not finish); load an earlier one, e.g. with resume 'auto'")
    meta = fmt.read_json(st.join(path, fmt.METADATA), "checkpoint metadata")
    if meta.get("format") != fmt.FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {fmt.FORMAT!r}")
    if per_rank_state not in ("error", "average"):
        raise ValueError(f"per_rank_state={per_rank_state!r}: use 'error' or 'average'")
    info = process_info(model)
    held = holdings(model)
    # saved with scan_layers' stored stacks and loaded without, or the reverse: [Note: loading across stored stacks]
    # (restack.py) names the checkpoint the model's way
    restack = rs.plan(meta, [h.name for h in held], model)
    if restack is not None:
        meta = restack.meta
    _check_params(path, meta, held)
    buffers = keys.buffers(model, persistent_only=False)  # by state-dict key, as saved
    _check_buffers(path, meta, buffers)
    index = fmt.RowIndex(path, range(meta["world_size"]))
    if restack is not None:
        index = restack.index(index)
    same_layout = meta["layout"] == layout_record(model)
    plan = _optimizer_plan(path, meta, optimizer, held, index, same_layout, info.rank, per_rank_state,
                           restack.same_group if restack is not None else list.__eq__)
    extra_path = st.join(path, fmt.extra_file(info.rank if info.rank < meta["world_size"] else 0))
    extra = _read_extra(extra_path)

    # read everything this process needs (a bad file fails here, before anything changes) ...
    index.open_all()
    setters = [h.read_param(index, f"param/{h.name}") for h in held]
    values = {name: index.read_rank(f"buffer/{name}", 0) for name in buffers}
    optim_state = plan() if optimizer is not None else None
    # ... then write it
    for set_param in setters:
        set_param()
    with torch.no_grad():
        for name, b in buffers.items():
            b.copy_(values[name].to(b.dtype).to(b.device))
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)
    _restore_rng(extra["rng"])
    for name, obj in (extra_state or {}).items():
        if name in extra["user"] and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(extra["user"][name])
    return {"step": meta.get("step"), "extra": extra["user"]}


def _check_params(path: str, meta: Dict[str, Any], held: List[Holding]) -> None:
    saved = meta["params"]
    mine = {h.name: h for h in held}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        parts = [f"the {has} has {names[:4]}{' ...' if len(names) > 4 else ''} which the {lacks} lacks"
                 for has, lacks, names in (("model", "checkpoint", missing), ("checkpoint", "model", unexpected))
                 if names]
        hint = ""
        if meta.get("stacked") or any(getattr(h.param, "_xla_fsdp_stacked", False) for h in held):
            hint = (" One side was wrapped with scan_layers=True, which stores the scanned layers' parameters "
                    "stacked ([Note: parameters stored stacked]); a stack loads into the same model without scan "
                    "and the reverse ([Note: loading across stored stacks]), but these names differ beyond that "
                    "(another depth or another model).")
        raise CheckpointError(f"checkpoint {path} is of another model: {'; '.join(parts)}. Nothing was loaded.{hint}")
    for name, h in mine.items():
        if list(h.full_shape) != saved[name]["shape"]:
            raise CheckpointError(f"checkpoint {path} is of another model: {name!r} is {tuple(saved[name]['shape'])} "
                                  f"there and {tuple(h.full_shape)} here. Nothing was loaded.")


def _check_buffers(path: str, meta: Dict[str, Any], buffers: Dict[str, torch.Tensor]) -> None:
    saved = meta.get("buffers", {})
    if set(saved) != set(buffers):
        raise CheckpointError(f"checkpoint {path} is of another model: buffers differ "
                              f"({sorted(set(saved) ^ set(buffers))[:4]}). Nothing was loaded.")
    for name, b in buffers.items():
        if list(b.shape) != saved[name]["shape"]:
            raise CheckpointError(f"checkpoint {path} is of another model: buffer {name!r} is "
                                  f"{tuple(saved[name]['shape'])} there and {tuple(b.shape)} here. Nothing was loaded.")


def _optimizer_plan(path, meta, optimizer, held, index, same_layout, rank, per_rank_state, same_group):
    """Check the optimizer against the checkpoint now; return a function that builds its state dict."""
    if optimizer is None:
        return None
    saved = meta.get("optimizer")
    if saved is None:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it without an optimizer "
                              "(the optimizer then starts fresh)")
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved["class"] != cls:
        raise CheckpointError(f"checkpoint {path} holds {saved['class']} state, the optimizer is {cls}; build the "
                              "same optimizer class as when saving")
    named = optimizer_names(optimizer, held)
    current = held_state_dict(optimizer)
    groups = current["param_groups"]
    if len(groups) != len(saved["param_groups"]) or any(
            not same_group([named[i].name for i in g["params"]], s["params"])
            for g, s in zip(groups, saved["param_groups"])):
        raise CheckpointError(f"checkpoint {path}: the optimizer's parameter groups differ from the saved ones "
                              "(same parameters, same order, same grouping needed)")
    by_name = {h.name: i for i, h in named.items()}  # holding name -> the optimizer's index
    for h_name, entries in saved["state"].items():
        for key, entry in entries.items():
            if entry["kind"] in ("rows", "whole") and not index.has(f"optim/{h_name}/{key}"):
                raise CheckpointError(f"checkpoint {path} lacks optimizer state {key!r} of {h_name!r}")
            if entry["kind"] == "whole" and named[by_name[h_name]].per_rank_states and per_rank_state == "error":
                raise CheckpointError(
                    f"checkpoint {path} holds optimizer state {key!r} of {h_name!r} computed over the whole "
                    "parameter by an SPMD run; here each process computes it over its own shard (e.g. "
                    "Adafactor's column factor), which has no exact value from it. Load under an SPMD runtime, "
                    "or pass per_rank_state='average' to give every rank the whole parameter's value")
            if entry["kind"] == "per_rank" and not same_layout and per_rank_state == "error":
                raise CheckpointError(
                    f"checkpoint {path} holds optimizer state {key!r} of {h_name!r} that each rank computed over "
                    f"its own shard (e.g. Adafactor's column factor); it has no exact value on this layout "
                    f"({meta['layout']} -> another). Load on the saved layout, or pass "
                    "per_rank_state='average' to use the mean over the saved ranks")

    def build() -> Dict[str, Any]:
        state: Dict[int, Dict[str, Any]] = {}
        for h_name, entries in saved["state"].items():
            h = named[by_name[h_name]]
            out: Dict[str, Any] = {}
            for key, entry in entries.items():
                if entry["kind"] == "scalar":
                    out[key] = torch.tensor(entry["value"], dtype=fmt.dtype_from_name(entry["dtype"])) \
                        if entry.get("tensor") else entry["value"]
                elif entry["kind"] == "rows":
                    out[key] = h.read_state(index, f"optim/{h_name}/{key}", torch.Size(entry["shape"]))
                elif entry["kind"] == "whole":  # a 0-dim one: a layer's Adafactor RMS out of a stack's
                    shape = entry["shape"]
                    value = index.read_rows(f"optim/{h_name}/{key}", 0, shape[0] if shape else 1)
                    out[key] = value.reshape(shape).to(h.param.device)
                else:
                    ranks = index.ranks_with(f"optim_rank/{h_name}/{key}")
                    if same_layout and rank in ranks:
                        value = index.read_rank(f"optim_rank/{h_name}/{key}", rank)
                    else:
                        value = torch.stack([index.read_rank(f"optim_rank/{h_name}/{key}", r) for r in ranks]).mean(0)
                    out[key] = value.to(h.param.device)
            state[by_name[h_name]] = out
        # JSON turned tuples (betas) into lists
        return {"state": state, "param_groups": [
            {**{k: tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
                for k, v in s["hyper"].items()}, "params": g["params"]}
            for g, s in zip(groups, saved["param_groups"])]}

    return build


def _read_extra(path: str) -> Dict[str, Any]:
    try:
        data = storage.storage_for(path).read_bytes(path)
    except (FileNotFoundError, IsADirectoryError):
        raise CheckpointError(f"checkpoint file is missing: {path}") from None
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint file is corrupt: {path} ({e})") from None


def _restore_rng(states: Dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
    if "xla" in states:
        with contextlib.suppress(Exception):
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(states["xla"])
