"""Saving a sharded checkpoint: every process writes what it holds, atomically.

[Note: atomic checkpoints] A checkpoint at a path (a local disk or a shared file system mounted on every host) is
written into `<path>.partial/`: each process writes its tensor file, its index and its own state, each fsynced; the
processes agree that every write succeeded; rank 0 writes metadata.json and the COMPLETE marker (fsynced), renames the
directory to `<path>` (atomic on POSIX) and fsyncs the parent. A crash before the rename leaves only a `.partial`
directory, which loading ignores and the next save of that step clears; the previous checkpoint is untouched. A write
that fails on any process fails the save on every process with the first error, after the partial directory is removed.

[Note: commit without rename] At a URL (`gs://`, `s3://`, any fsspec file system: storage.py) there is no atomic rename,
so the COMPLETE marker alone commits. Rank 0 first removes `<path>/COMPLETE` if a checkpoint of that step exists, then
everything else there, so no reader ever sees a half-overwritten checkpoint as complete (the old copy of that step is
gone from then on). Every process writes straight into `<path>/`; once all agree every write succeeded (`all_ok`), rank
0 writes metadata.json and, last, COMPLETE (an object appears only once its upload finished). Readers (`is_complete`,
`latest_checkpoint`, load, consolidate) ignore a directory without the marker, so a crash leaves at worst ignored files,
cleared by the next save of that step. A failed write fails the save everywhere and rank 0 removes what was written.
Rotation (manager.py) and any removal take the marker away first too (`format.remove_checkpoint`). The processes may be
hosts of an SPMD slice (each writing its own `shards-rank<host>` files) or one per chip.

[Note: saves beside training] A save has three parts: `begin_save` (every process, at a step boundary: the directory
prepared and agreed on and, for a save written beside training, this process's tensors copied to host memory and the
record taken: the only stall), `PendingSave.write` (this process's files; no collective, so a thread may run it while
the next steps train), and `PendingSave.commit` (every process, on the training thread: the agreement that every write
succeeded, then rank 0's metadata, COMPLETE and rename). `save_checkpoint` runs the three in a row and copies each
tensor only as it writes it; CheckpointManager(async_save=True) writes beside training (manager.py), holding one
checkpoint's worth of this process's shards in host memory until the write ends."""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import platform
import random
import threading
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from . import format as fmt
from ..collective_engine import model_state as keys
from . import host_shards as hs
from . import storage
from ..collective_engine.sharded_param import stored_shape
from ..runtime import stored_keys
from ..collective_engine.optimizer_state import held_state_dict  # the padded global tensors, written row by row
from .holdings import Holding, holdings, layout_record, optimizer_names, process_info


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one is intact."""


def save_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    step: Optional[int] = None, extra_state: Optional[Dict[str, Any]] = None) -> str:
    """Write a sharded checkpoint of `model` (and `optimizer`) to directory `path`; call on every process.

    `path` is a local or mounted path, or an fsspec URL (`gs://bucket/run/checkpoint-500`; gs:// needs gcsfs:
    `pip install xla_fsdp[gcs]`).

    `extra_state` maps names to objects with `state_dict()` (an LR scheduler, a data loader's position) or to plain
    picklable values; each process saves its own, together with its RNG states (torch, XLA, Python, NumPy). Returns
    `path`."""
    pending = begin_save(path, model, optimizer, step=step, extra_state=extra_state)
    pending.write()
    return pending.commit()


def begin_save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               step: Optional[int] = None, extra_state: Optional[Dict[str, Any]] = None,
               copy_now: bool = False) -> "PendingSave":
    """The first part of a save ([Note: saves beside training]); every process calls it at the same step boundary.
    `copy_now`: take this process's tensors to host memory now, so that training may go on while `write()` runs on
    another thread; else each is copied as it is written."""
    st = storage.storage_for(path)
    path = st.abspath(path)
    info = process_info(model)
    held = holdings(model)
    # where the files go: [Note: atomic checkpoints] on a file system, [Note: commit without rename] at a URL
    target = path + fmt.PARTIAL_SUFFIX if st.renames else path
    pending = PendingSave(st, path, target, info)
    try:
        if info.rank == 0:
            _prepare(st, target)
    except OSError as e:
        pending.error = e
    if not info.all_ok(pending.error is None):  # the directory is ready (every process waits for rank 0 here)
        pending.fail()
    pending.files = _rank_files(info.rank, model, held, optimizer, extra_state, copy_now)
    if info.rank == 0:  # the record of this step, taken before training changes the optimizer's state
        to_json = getattr(getattr(model, "config", None), "to_json_string", None)  # a Hugging Face config's JSON
        pending.record = (_metadata(model, held, optimizer, step, info), to_json() if to_json else None)
    return pending


class PendingSave:
    """A save begun at a step boundary: `write()` (any thread), then `commit()` ([Note: saves beside training])."""

    def __init__(self, st: storage.Storage, path: str, target: str, info):
        self.st, self.path, self.target, self.info = st, path, target, info
        self.files = None  # (entries, index, extra bytes) of this process
        self.record = None  # rank 0: (metadata, the model's config as JSON or None)
        self.error: Optional[BaseException] = None
        self.written = threading.Event()

    def write(self) -> None:
        """This process's tensor file, index and state; an error is kept for `commit` to report."""
        try:
            _write_rank_files(self.st, self.target, self.info.rank, *self.files)
        except Exception as e:  # on a thread nothing else would see it: every process hears of it at commit
            self.error = e
        finally:
            self.files = None  # the host copies go as soon as they are written
            self.written.set()

    def commit(self) -> str:
        """Every process: agree that every write succeeded, then rank 0 commits; returns the path."""
        if not self.info.all_ok(self.error is None):
            self.fail()
        if self.info.rank == 0:
            try:
                _finish(self.st, self.target, self.path, *self.record)
            except OSError as e:
                self.error = e
                self.st.rmtree(self.target, ignore_errors=True)
        if not self.info.all_ok(self.error is None):
            where = self.error if self.error is not None else "rank 0 could not commit it"
            raise CheckpointWriteError(f"could not write checkpoint {self.path} ({where}); earlier checkpoints are "
                                       "untouched") from self.error
        return self.path

    def fail(self) -> None:
        """Some process could not write: rank 0 removes what was written, every process raises."""
        if self.info.rank == 0:
            self.st.rmtree(self.target, ignore_errors=True)
        self.info.barrier()
        error = self.error
        where = f"rank {self.info.rank}: {error}" if error is not None else "another rank failed to write its files"
        raise CheckpointWriteError(f"could not write checkpoint {self.path} ({where}); nothing was saved there and "
                                   "earlier checkpoints are untouched") from error


def _prepare(st: storage.Storage, target: str) -> None:
    """Rank 0, before anyone writes: an empty directory at `target`."""
    if st.renames:
        st.rmtree(target)  # an earlier save of this step that did not finish
        st.makedirs(target, exist_ok=False)
    else:
        fmt.remove_checkpoint(target)  # the marker first: [Note: commit without rename]
        st.makedirs(target, exist_ok=True)


# -- one process's files ----------------------------------------------------------

def _rank_files(rank: int, model, held: List[Holding], optimizer, extra_state, copy_now: bool):
    """This process's (entries, index, extra state as bytes): each entry's `produce` copies its tensor to host memory
    when called, or, with `copy_now`, returns the copy taken here."""
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
            if kind in ("rows", "whole"):  # "whole": an SPMD global tensor not shaped like its parameter
                pieces = h.pieces(value) if kind == "rows" else hs.pieces_to_write(f"{h.name}/{key}", value,
                                                                                    value.shape[0], h.view)
                add_pieces(f"optim/{h.name}/{key}", pieces, value.dtype, tuple(value.shape[1:]))
            elif kind == "per_rank":
                add(f"optim_rank/{h.name}/{key}", lambda v=value: v.detach().cpu(), value.dtype,
                    tuple(value.shape), None)
    if rank == 0:
        for name, b in keys.buffers(model, persistent_only=False).items():  # by state-dict key
            add(f"buffer/{name}", lambda b=b: b.detach().cpu(), b.dtype, tuple(b.shape), None)
    if copy_now:
        live = _host_storages(model, optimizer)
        entries = [(key, dtype, shape, _copied(produce(), live)) for key, dtype, shape, produce in entries]
    extra = {"rng": _rng_states(), "user": {name: obj.state_dict() if hasattr(obj, "state_dict") else obj
                                            for name, obj in (extra_state or {}).items()}}
    buf = io.BytesIO()  # small (RNG states, user objects); one write suits every storage
    torch.save(extra, buf)
    return entries, index, buf.getvalue()


def _host_storages(model, optimizer) -> set:
    """The storages of the model's and optimizer's tensors that live in host memory (a model on the CPU device): a copy
    taken for a save beside training must not be one of them."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}


def _copied(tensor: torch.Tensor, live: set):
    """`produce` for a copy taken now: a host tensor still shared with training is cloned."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    elif tensor.untyped_storage().data_ptr() in live:
        tensor = tensor.clone()
    return lambda: tensor


def _write_rank_files(st: storage.Storage, partial: str, rank: int, entries, index, extra: bytes) -> None:
    shard_path = st.join(partial, fmt.shard_file(rank))
    for key, crc in fmt.write_safetensors(shard_path, entries).items():
        index[key]["crc32"] = crc
    fmt.write_json(st.join(partial, fmt.index_file(rank)),
                   {"rank": rank, "bytes": st.size(shard_path), "tensors": index})
    st.write_bytes(st.join(partial, fmt.extra_file(rank)), extra)


def _optimizer_tensors(optimizer, held):
    """(holding, state key, value, kind) for every optimizer state entry."""
    named = optimizer_names(optimizer, held)
    state = held_state_dict(optimizer)["state"]
    for index, entries in sorted(state.items()):
        h = named[index]
        for key, value in entries.items():
            yield h, key, value, h.state_kind(key, value)


def _rng_states() -> Dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    with contextlib.suppress(ImportError):
        import numpy as np

        states["numpy"] = np.random.get_state()
    with contextlib.suppress(Exception):  # no XLA runtime in this process (gloo tests, offline tools)
        import torch_xla.core.xla_model as xm

        states["xla"] = xm.get_rng_state()
    return states


# -- rank 0: the record and the commit ------------------------------------------------

def _finish(st: storage.Storage, partial: str, path: str, metadata: Dict[str, Any], config_json: Optional[str]) -> None:
    fmt.write_json(st.join(partial, fmt.METADATA), metadata)
    if config_json is not None:
        st.write_bytes(st.join(partial, fmt.HF_CONFIG), config_json.encode())
    st.write_bytes(st.join(partial, fmt.COMPLETE), b"complete\n")  # last: the commit at a URL
    if not st.renames:
        return
    st.sync_dir(partial)
    if st.exists(path):
        # saving the same step again: the old copy goes only once the new one is complete
        old = path + ".replaced"
        st.rmtree(old, ignore_errors=True)
        st.rename(path, old)
        st.rename(partial, path)
        st.rmtree(old, ignore_errors=True)
    else:
        st.rename(partial, path)
    st.sync_dir(os.path.dirname(path))


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
                    for name, b in keys.buffers(model, persistent_only=False).items()},
        "versions": _versions(),
    }
    stacks = stored_keys.stack_table(model)
    if stacks:  # scan_layers' stored stacks: consolidation writes their layers' keys
        meta["stacked"] = stacks
    if optimizer is not None:
        sd = held_state_dict(optimizer)
        named = optimizer_names(optimizer, held)
        groups = [{"hyper": _jsonable({k: v for k, v in group.items() if k != "params"}),
                   "params": [named[i].name for i in group["params"]]} for group in sd["param_groups"]]
        states = {}
        for h, key, value, kind in _optimizer_tensors(optimizer, held):
            entry = {"kind": kind}
            is_tensor = isinstance(value, torch.Tensor)  # every kind but "scalar" is a tensor
            if kind == "scalar":
                entry.update(value=value.item() if is_tensor else value, tensor=is_tensor)
            elif kind == "rows":
                # shaped like the parameter, or its rows with trailing dims averaged away
                same = tuple(value.shape) == tuple(stored_shape(h.param))
                entry["shape"] = list(h.full_shape) if same else [h.num_rows, *value.shape[1:]]
            elif kind == "whole":
                entry["shape"] = list(value.shape)
            if is_tensor:
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
    return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torch_xla", "transformers", "safetensors"):
        with contextlib.suppress(Exception):
            out[name] = __import__(name).__version__
    with contextlib.suppress(Exception):
        out["xla_fsdp"] = importlib.metadata.version("xla_fsdp")
    return out
