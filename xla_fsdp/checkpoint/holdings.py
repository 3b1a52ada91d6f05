"""What this process holds of each parameter and optimizer state, in rows of the full tensor.

A checkpoint stores rows of full (unwrapped, unpadded) tensors; this module maps every place a parameter can live to
rows and back:

- the collective engine, one process per device: a shard, rows [r * rows_per_rank, (r + 1) * rows_per_rank) clipped to
  the real rows; only the first sharding group writes (the other groups hold copies);
- the SPMD runtimes (the collective engine's single controller, its global tensors padded on dim 0; the GSPMD engine; a
  plain module under SPMD): one global tensor per parameter, of which this host writes and reads only the rows on its
  own devices, each row once across hosts (`SpmdHolding`, host_shards.py);
- anything else (a plain module): the tensor itself, all rows.

A parameter of shape (d0, *rest) has d0 rows of shape rest; a 0-dim one has one row of shape (). Optimizer state follows
its parameter when it has the parameter's (local) shape, or is Adafactor's row factor (the parameter's rows, the last
dim averaged away); other tensors (Adafactor's column factor, which each shard computes over its own rows) belong to the
rank that computed them; under SPMD such tensors are global ("whole") and saved like any other."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from ..runtime import hosts
from ..runtime.real_rows import real_shape
from ..collective_engine import model_state as keys
from ..unit_state import state_of, units
from ..collective_engine.sharded_param import stored_shape
from ..collective_engine.optimizer_state import ROW_FACTORED  # state with one entry per parameter row
from ..runtime.hosts import HostView
from . import host_shards as hs


@dataclass
class ProcessInfo:
    """This process's place in the job, for file names and agreement."""

    rank: int
    world: int
    barrier: Callable[[], None]
    all_ok: Callable[[bool], bool]  # True on every process iff `ok` is True on every process


class Holding:
    """One parameter: its full shape and how this process holds it."""

    def __init__(self, name: str, aliases: List[str], param: torch.Tensor, full_shape: torch.Size,
                 rows: Tuple[int, int], writes: bool, load: Callable[[torch.Tensor], None],
                 local_rows: int, place_state: Callable[[torch.Tensor, torch.Size], torch.Tensor]):
        self.name = name
        self.aliases = aliases
        self.param = param
        self.full_shape = torch.Size(full_shape)
        self.rows = rows  # [start, stop) of the full parameter's rows held here (padding excluded)
        self.writes = writes
        self.load = load  # sets the parameter from its full rows [self.rows) (a host tensor)
        self.local_rows = local_rows  # dim 0 of the local tensor (padding included)
        # (rows of an optimizer state tensor, its full shape) -> the tensor the optimizer keeps for this parameter
        self.place_state = place_state

    @property
    def row_shape(self) -> Tuple[int, ...]:
        return tuple(self.full_shape[1:])

    @property
    def num_rows(self) -> int:
        return self.full_shape[0] if len(self.full_shape) else 1

    def as_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """A local tensor shaped like the parameter -> its real rows, on the host."""
        t = tensor.detach().reshape(self.local_rows, *tensor.shape[1:]) if tensor.dim() else tensor.detach().reshape(1)
        return t[: self.rows[1] - self.rows[0]].cpu()

    # optimizer state that is neither shaped like the parameter nor its rows is per rank here (one process per chip:
    # each computed it over its own shard); SPMD: "whole" global tensors
    per_rank_states = True

    def pieces(self, tensor: torch.Tensor):
        """[(start, stop, produce rows)] of `tensor` (shaped like the parameter here) that this process writes."""
        return [(self.rows[0], self.rows[1], lambda: self.as_rows(tensor))] if self.writes else []

    def read_param(self, index, key: str) -> Callable[[], None]:
        """Read this process's rows of parameter `key` now; the returned call sets them."""
        rows = index.read_rows(key, *self.rows).to(self.param.dtype)
        return lambda: self.load(rows)

    def read_state(self, index, key: str, full_shape: torch.Size) -> torch.Tensor:
        """An optimizer state tensor following the parameter ("rows"), read and placed."""
        return self.place_state(index.read_rows(key, *self.rows), torch.Size(full_shape))

    def state_kind(self, key: str, value: Any) -> str:
        """"rows", "scalar" or "per_rank" (see the module docstring)."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return "scalar"
        if tuple(value.shape) == tuple(stored_shape(self.param)) or \
                (key in ROW_FACTORED and value.shape[0] == self.local_rows):
            return "rows"
        return "per_rank"


def _padded(rows: torch.Tensor, total: int) -> torch.Tensor:
    pad = total - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad > 0 else rows


class SpmdHolding(Holding):
    """A parameter under an SPMD runtime: one global tensor (padded on dim 0 by the single controller), of which this
    host writes and reads only its devices' rows (host_shards.py)."""

    per_rank_states = False

    def __init__(self, name, aliases, param, full_shape, view: HostView):
        rows = full_shape[0] if len(full_shape) else 1
        super().__init__(name, aliases, param, full_shape, (0, rows), True, None,
                         stored_shape(param)[0] if param.dim() else 1, None)
        self.view = view

    def pieces(self, tensor):
        return hs.pieces_to_write(self.name, tensor, self.num_rows, self.view)

    def read_param(self, index, key):
        new = self._read(index, key, self.param, self.param.dtype)

        def apply():
            with torch.no_grad():
                self.param.data = new
        return apply

    def read_state(self, index, key, full_shape):
        dtype = index.dtype_of(key)
        if tuple(full_shape) == tuple(self.full_shape):
            return self._read(index, key, self.param, dtype)
        # a row factor ([rows]): every host reads it whole, replicated like the unsharded state
        return self._whole(index.read_rows(key, 0, full_shape[0]), self.local_rows)

    def state_kind(self, key, value):
        kind = super().state_kind(key, value)
        return "whole" if kind == "per_rank" else kind

    def _read(self, index, key, like, dtype):
        if like.dim() and hs.is_sharded(like):
            reader = hs.ShardReader(self.view, hosts.host_group(self.view))
            shards = reader.shards(like, self.num_rows, lambda a, b: index.read_rows(key, a, b), dtype)
            return reader.place(like, shards)
        rows = index.read_rows(key, 0, self.num_rows).to(dtype)
        return self._whole(rows, self.local_rows).reshape(like.shape)

    def _whole(self, rows, total):
        """True rows, padded to `total`, on the devices replicated (every host read all of them)."""
        return _padded(rows, total).to(self.param.device) if rows.dim() else rows.to(self.param.device)


def spmd_runtime(model: nn.Module) -> bool:
    """Whether `model` runs under an SPMD runtime (its parameters are global XLA tensors)."""
    if "torch_xla" not in sys.modules:
        return False
    import torch_xla.runtime as xr

    return xr.is_spmd() and any(p.device.type == "xla" for p in model.parameters())


def holdings(model: nn.Module) -> List[Holding]:
    """Every parameter of `model` (tied ones once, under their first name), as held here, named by its `state_dict()`
    key."""
    records = {id(rec.sharded): (rec, state.group.comm) for state in map(state_of, model.modules())
               if state is not None for rec in state.group.params}
    # checkpoints name parameters by their state-dict key ([Note: state-dict keys])
    table = keys.names(model)
    names: Dict[int, List[str]] = {}
    params: Dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(keys.key_of(table, name))
        params[id(p)] = p
    out = []
    view = hosts.host_view() if spmd_runtime(model) else None
    for pid, p in params.items():
        name, aliases = names[pid][0], names[pid][1:]
        if view is not None:
            # the single controller's padded global tensors; the SPMD engine's padded rows
            full = records[pid][0].orig_shape if pid in records else real_shape(p)
            out.append(SpmdHolding(name, aliases, p, full, view))
        elif pid in records:
            out.append(_engine_holding(name, aliases, p, *records[pid]))
        else:
            out.append(_plain_holding(name, aliases, p))
    return out


def _engine_holding(name, aliases, param, rec, comm) -> Holding:
    """One process per chip: this rank's shard (the single controller is an SPMD runtime: SpmdHolding)."""
    layout = comm.layout
    start = min(layout.shard_rank * rec.rows_per_rank, rec.rows)
    stop = min(start + rec.rows_per_rank, rec.rows)
    writes = layout.rank in layout.shard_groups[0]

    def load(local_rows):
        rec.load_shard(_padded(local_rows, rec.rows_per_rank).reshape(rec.shard_shape), comm)

    def place(state_rows, full_shape):
        return _padded(state_rows, rec.rows_per_rank).to(comm.device)

    return Holding(name, aliases, param, rec.orig_shape, (start, stop), writes, load, rec.rows_per_rank, place)


def _plain_holding(name, aliases, param) -> Holding:
    full = param.shape
    rows = full[0] if len(full) else 1

    def load(full_rows):
        value = full_rows.reshape(full)
        with torch.no_grad():
            if param.device.type == "xla":
                param.data = _like(param, value.to(param.dtype))
            else:
                param.copy_(value)

    def place(state_rows, full_shape):
        return _like(param, state_rows.reshape(full_shape))

    return Holding(name, aliases, param, full, (0, rows), True, load, rows, place)


def _like(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` on `reference`'s device, with its sharding when it has one (GSPMD)."""
    moved = value.to(reference.device)
    if reference.device.type == "xla":
        import torch_xla

        sharding = torch_xla._XLAC._get_xla_op_sharding(reference)
        if sharding is not None and value.shape == stored_shape(reference):
            torch_xla._XLAC._xla_mark_sharding(moved, sharding)
    return moved


def _engine_comm(model: nn.Module):
    """The collective engine's collectives of `model` (None: a plain or GSPMD-engine model)."""
    return next((state_of(m).group.comm for m in units(model)), None)


def process_info(model: nn.Module) -> ProcessInfo:
    """Rank, world size and agreement for the processes that save or load together."""
    comm = _engine_comm(model)
    if comm is not None and not comm.is_single_controller:
        return ProcessInfo(comm.layout.rank, comm.layout.world_size, comm.barrier, comm.all_ok)
    if spmd_runtime(model):
        # one process per host: each writes its devices' rows (host_shards.py), agreeing over gloo
        group = hosts.host_group()
        return ProcessInfo(group.rank, group.world, group.barrier, group.all_ok)
    return ProcessInfo(0, 1, lambda: None, lambda ok: ok)


def layout_record(model: nn.Module) -> Dict[str, Any]:
    """How the model is laid out (recorded with a checkpoint; equal records mean per-rank state can be loaded back rank
    by rank)."""
    comm = _engine_comm(model)
    if spmd_runtime(model):
        runtime = "single_controller" if comm is not None else "gspmd or plain"
        return {"engine": "spmd", "runtime": runtime, "hosts": hosts.host_view().count}
    if comm is None:
        return {"engine": "plain or GSPMD", "processes": 1}
    layout = comm.layout
    return {"engine": "collectives",
            "runtime": "single_controller" if comm.is_single_controller else "multi_process",
            "world_size": layout.world_size, "shard_groups": [list(g) for g in layout.shard_groups]}


def optimizer_names(optimizer, held: List[Holding]) -> Dict[int, Holding]:
    """Optimizer parameter index (its state_dict numbering) -> the holding of that parameter."""
    by_id = {id(h.param): h for h in held}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if id(p) not in by_id:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the model; build it "
                "from model.parameters() after wrapping")
    return {index: by_id[id(p)] for index, p in enumerate(params)}
