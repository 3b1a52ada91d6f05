"""Saving a sharded checkpoint: every process writes what it holds, atomically.

[Note: atomic checkpoints] A checkpoint is written into `<path>.partial/`:
each process writes its tensor file, its index and its own state, each
fsynced; the processes then agree that every write succeeded; rank 0 writes
metadata.json and the COMPLETE marker (fsynced), renames the directory to
`<path>` (atomic on a POSIX file system) and fsyncs the parent. A crash at any
point before the rename leaves only a `.partial` directory, which loading
ignores and the next save of that step clears, and the previous checkpoint is
untouched. A write that fails (full disk, permissions) on any process fails
the save on every process with the first error, after the partial directory
is removed; nothing else is touched.
"""
from __future__ import annotations

import os
import platform
import random
import shutil
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from . import format as fmt
from .. import state_keys as keys
from . import host_shards as hs
from .holdings import Holding, holdings, layout_record, optimizer_names, process_info


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one is intact."""


def save_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    step: Optional[int] = None, extra_state: Optional[Dict[str, Any]] = None) -> str:
    """Write a sharded checkpoint of `model` (and `optimizer`) to directory `path`; call on every process.

    `extra_state` maps names to objects with `state_dict()` (an LR scheduler, a
    data loader's position) or to plain picklable values; each process saves
    its own, together with its RNG states (torch, XLA, Python, NumPy).
    Returns `path`.
    """
    path = os.path.abspath(path)
    info = process_info(model)
    held = holdings(model)
    partial = path + fmt.PARTIAL_SUFFIX
    if info.rank == 0 and os.path.exists(partial):
        shutil.rmtree(partial)  # an earlier save of this step that did not finish
    info.barrier()
    error: Optional[BaseException] = None
    try:
        if info.rank == 0:
            os.makedirs(partial, exist_ok=False)
        info.barrier() if info.world > 1 else None
        _write_rank_files(partial, info.rank, model, held, optimizer, extra_state)
    except OSError as e:
        error = e
    if not info.all_ok(error is None):
        if info.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        info.barrier()
        where = f"rank {info.rank}: {error}" if error is not None else "another rank failed to write its files"
        raise CheckpointWriteError(f"could not write checkpoint {path} ({where}); nothing was saved there and "
                                   "earlier checkpoints are untouched") from error
    if info.rank == 0:
        try:
            _finish(partial, path, model, held, optimizer, step, info)
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointWriteError(f"could not write checkpoint {path} ({e}); earlier checkpoints are "
                                       "untouched") from e
    info.barrier()
    return path


# -- one process's files ----------------------------------------------------------

def _named_buffers(model: nn.Module):
    return list(keys.buffers(model, persistent_only=False).items())  # by state-dict key


def _write_rank_files(partial: str, rank: int, model, held: List[Holding], optimizer, extra_state) -> None:
    entries, index = [], {}

    def add(key, tensor_fn, dtype, shape, rows, tensor=None):
        entries.append((key, dtype, shape, tensor_fn))
        index[key] = {"rows": rows, "dtype": fmt.dtype_name(dtype), "shape": list(shape)}
        if tensor is not None:
            index[key]["tensor"] = tensor

    def add_pieces(key, pieces, dtype, row_shape):
        # several pieces of one tensor in this file are stored as "<key>@<first row>"
        for start, stop, produce in pieces:
            add(key if len(pieces) == 1 else f"{key}@{start}", produce, dtype, (stop - start, *row_shape),
                [start, stop], None if len(pieces) == 1 else key)

    for h in held:
        add_pieces(f"param/{h.name}", h.pieces(h.param), h.param.dtype, h.row_shape)
    if optimizer is not None:
        for h, key, value, kind in _optimizer_tensors(optimizer, held):
            if kind == "rows":
                add_pieces(f"optim/{h.name}/{key}", h.pieces(value), value.dtype, tuple(value.shape[1:]))
            elif kind == "whole":  # an SPMD global tensor not shaped like its parameter
                add_pieces(f"optim/{h.name}/{key}", hs.pieces_to_write(f"{h.name}/{key}", value, value.shape[0], h.view),
                           value.dtype, tuple(value.shape[1:]))
            elif kind == "per_rank":
                add(f"optim_rank/{h.name}/{key}", lambda v=value: v.detach().cpu(), value.dtype,
                    tuple(value.shape), None)
    if rank == 0:
        for name, b in _named_buffers(model):
            add(f"buffer/{name}", lambda b=b: b.detach().cpu(), b.dtype, tuple(b.shape), None)
    shard_path = os.path.join(partial, fmt.shard_file(rank))
    crcs = fmt.write_safetensors(shard_path, entries)
    for key, crc in crcs.items():
        index[key]["crc32"] = crc
    fmt.write_json(os.path.join(partial, fmt.index_file(rank)),
                   {"rank": rank, "bytes": os.path.getsize(shard_path), "tensors": index})
    extra = {"rng": _rng_states(), "user": {}}
    for name, obj in (extra_state or {}).items():
        extra["user"][name] = obj.state_dict() if hasattr(obj, "state_dict") else obj
    extra_path = os.path.join(partial, fmt.extra_file(rank))
    torch.save(extra, extra_path)
    fmt.fsync_path(extra_path)


def _optimizer_tensors(optimizer, held):
    """(holding, state key, value, kind) for every optimizer state entry."""
    named = optimizer_names(optimizer, held)
    state = optimizer.state_dict()["state"]
    for index, entries in sorted(state.items()):
        h = named[index]
        for key, value in entries.items():
            yield h, key, value, h.state_kind(key, value)


def _rng_states() -> Dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    try:
        import torch_xla.core.xla_model as xm

        states["xla"] = xm.get_rng_state()
    except Exception:  # no XLA runtime in this process (gloo tests, offline tools)
        pass
    return states


# -- rank 0: the record and the rename ------------------------------------------------

def _finish(partial: str, path: str, model, held, optimizer, step, info) -> None:
    fmt.write_json(os.path.join(partial, fmt.METADATA), _metadata(model, held, optimizer, step, info))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        with open(os.path.join(partial, fmt.HF_CONFIG), "w") as f:
            f.write(config.to_json_string())
            f.flush()
            os.fsync(f.fileno())
    with open(os.path.join(partial, fmt.COMPLETE), "w") as f:
        f.write("complete\n")
        f.flush()
        os.fsync(f.fileno())
    fmt.fsync_path(partial)
    if os.path.exists(path):
        # saving the same step again: the old copy goes only once the new one is complete
        old = path + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, path)
    fmt.fsync_path(os.path.dirname(path))


def _metadata(model, held, optimizer, step, info) -> Dict[str, Any]:
    params = {h.name: {"shape": list(h.full_shape), "dtype": fmt.dtype_name(h.param.dtype), "aliases": h.aliases}
              for h in held}
    meta: Dict[str, Any] = {
        "format": fmt.FORMAT,
        "step": step,
        "world_size": info.world,
        "layout": layout_record(model),
        "params": params,
        "buffers": {name: {"shape": list(b.shape), "dtype": fmt.dtype_name(b.dtype)}
                    for name, b in _named_buffers(model)},
        "versions": _versions(),
    }
    if optimizer is not None:
        sd = optimizer.state_dict()
        named = optimizer_names(optimizer, held)
        groups = []
        for group in sd["param_groups"]:
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"hyper": _jsonable(hyper), "params": [named[i].name for i in group["params"]]})
        states = {}
        for h, key, value, kind in _optimizer_tensors(optimizer, held):
            entry = {"kind": kind}
            if kind == "scalar":
                entry["value"] = value.item() if isinstance(value, torch.Tensor) else value
                entry["tensor"] = isinstance(value, torch.Tensor)
                if isinstance(value, torch.Tensor):
                    entry["dtype"] = fmt.dtype_name(value.dtype)
            elif kind == "rows":
                # shaped like the parameter, or its rows with trailing dims averaged away
                same = tuple(value.shape) == tuple(h.param.shape)
                entry["shape"] = list(h.full_shape) if same else [h.num_rows, *value.shape[1:]]
                entry["dtype"] = fmt.dtype_name(value.dtype)
            elif kind == "whole":
                entry["shape"] = list(value.shape)
                entry["dtype"] = fmt.dtype_name(value.dtype)
            else:
                entry["dtype"] = fmt.dtype_name(value.dtype)
            states.setdefault(h.name, {})[key] = entry
        meta["optimizer"] = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                             "param_groups": groups, "state": states}
    return meta


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torch_xla", "transformers", "safetensors"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            pass
    try:
        from importlib.metadata import version

        out["xla_fsdp"] = version("xla_fsdp")
    except Exception:
        pass
    return out
