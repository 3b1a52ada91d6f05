"""`FSDPParam`: the record of one sharded parameter.

[Note: dim-0 sharding] A parameter of shape (d0, *rest) is viewed as d0 rows (a 0-d parameter as one row), padded
with zero rows to `rows_per_rank * N`, and rank r keeps rows [r*rows_per_rank, (r+1)*rows_per_rank). Every rank
holds the same shard shape, so one flat all-gather of the concatenated shards of a unit rebuilds every parameter.
Padding rows carry zero gradients, so optimizers leave them at zero and norms are unaffected.

[Note: shards in whole tiles]
A TPU lays a bf16 matrix out in tiles of 16 rows (8 sublanes, two rows packed in each) by 128 lanes. A shard whose
row count is not a multiple of 16 cannot be viewed as the flat [n, 128] buffer the collectives move without a
relayout, which libtpu generates as one huge kernel (GPT-2's 50,257-row embedding over 4 chips: 12,565 rows a chip,
seconds of register allocation per reshape; docs/scan.md). So on XLA a matrix (2-D or more) whose rows per shard
are not a multiple of 16 gets zero rows up to one, when that adds at most 1/32 of its rows. The bound keeps the
bytes: padding also costs every collective the rows' bytes and, where the rows divided evenly, a copy of the
gathered parameter to cut them off (with a 1/8 bound the 64B on v4-256 sent 7.5% more bytes and projected slower).
Only the stored shards grow; the gathered parameter, state dicts and checkpoints are the real rows. Per-rank files
saved by `state_dict()` under one process per chip (torch_xla's flow) hold the shards as stored, so one written
before this rule holds fewer rows of a padded table than the model now shards (loading one was not tried);
`consolidate_sharded_model_checkpoints` reads either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn

from .. import abstract


@dataclass(frozen=True)
class ParamSite:
    """One place a parameter is registered (tied parameters have several)."""

    module: nn.Module
    name: str
    fqn: str  # relative to the unit's module, for messages


class FSDPParam:
    """Sizes, padding and the local shard of one parameter."""

    def __init__(self, full: torch.Tensor, sites: List[ParamSite], comm, param_cls: type = nn.Parameter,
                 keep_meta: bool = False):
        self.sites = sites
        self.orig_shape = full.shape
        self.requires_grad = full.requires_grad
        self.orig_dtype = full.dtype
        self.rows = full.shape[0] if full.dim() > 0 else 1
        self.row_shape: Tuple[int, ...] = tuple(full.shape[1:]) if full.dim() > 0 else ()
        self.row_numel = math.prod(self.row_shape)
        self.world = comm.layout.shard_world_size
        self.rows_per_rank = max(1, -(-self.rows // self.world))
        if comm.is_xla and full.dim() >= 2 and full.is_floating_point():
            self.rows_per_rank = _whole_tiles(self.rows_per_rank)  # [Note: shards in whole tiles]
        self.padded_rows = self.rows_per_rank * self.world
        self.shard_shape = (self.rows_per_rank, *self.row_shape)
        self.shard_numel = self.rows_per_rank * self.row_numel
        if keep_meta and full.is_meta and not abstract.active():
            # FSDP2's flow: storage comes with to_empty() (`materialize_on`)
            data = self.padded(full) if comm.is_single_controller else self.local_rows(full, comm.layout.shard_rank)
        elif comm.is_single_controller:
            # one global tensor of every shard ([Note: single-controller runtime])
            data = comm.place_global(self.padded(full))
        else:
            data = self._local_rows(full, comm.layout.shard_rank, comm.device)
        self.param_cls = param_cls
        self.sharded = param_cls(data, requires_grad=self.requires_grad)

    @classmethod
    def stack_of(cls, per_layer: List["FSDPParam"], sites: List[ParamSite], data: torch.Tensor) -> "FSDPParam":
        """The record of `per_layer` (one parameter of each scanned layer) stored as one stack `data`: (d0, L, *rest),
        sharded on dim 0 with each layer's own rows per shard ([Note: the collectives engine's stored stacks] in
        stacked_units.py)."""
        first = per_layer[0]
        rec = cls.__new__(cls)
        rec.sites, rec.requires_grad, rec.orig_dtype = sites, first.requires_grad, first.orig_dtype
        rec.rows, rec.world, rec.rows_per_rank = first.rows, first.world, first.rows_per_rank
        rec.row_shape = (len(per_layer), *first.row_shape)
        rec.orig_shape = torch.Size((first.rows, *rec.row_shape))
        rec.row_numel = math.prod(rec.row_shape)
        rec.padded_rows = first.padded_rows
        rec.shard_shape = (rec.rows_per_rank, *rec.row_shape)
        rec.shard_numel = rec.rows_per_rank * rec.row_numel
        rec.param_cls = first.param_cls
        rec.sharded = first.param_cls(data, requires_grad=rec.requires_grad)
        return rec

    @property
    def fqn(self) -> str:
        return self.sites[0].fqn

    def local_rows(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s padded rows of `full` (a view of it unless padding was needed)."""
        rows = full.detach().reshape(self.rows, *self.row_shape)
        start = min(rank * self.rows_per_rank, self.rows)
        local = rows[start:start + self.rows_per_rank]
        pad = self.rows_per_rank - local.shape[0]
        return torch.cat([local, rows.new_zeros(pad, *self.row_shape)]) if pad else local

    def padded(self, full: torch.Tensor) -> torch.Tensor:
        """`full` as (padded_rows, *row_shape): every rank's rows, zero rows appended."""
        rows = full.detach().reshape(self.rows, *self.row_shape)
        pad = self.padded_rows - self.rows
        return torch.cat([rows, rows.new_zeros(pad, *self.row_shape)]) if pad else rows

    def _local_rows(self, full: torch.Tensor, rank: int, device: torch.device) -> torch.Tensor:
        """This rank's padded rows on `device`, in memory of their own. One copy of the rows is made, never two:
        the full tensor is about to be freed, so the shard must not be a view of it, but a move to another device
        copies already, and a clone before it would put a second copy of the shard in host memory at the peak. On
        XLA:CPU the clone is the copy and the move is free ([Note: XLA:CPU shards without a transfer])."""
        local = self.local_rows(full, rank)
        if local.is_meta:  # traced for the ahead-of-time check: a placeholder ([Note: abstract tracing])
            return abstract.to_device(local, device)
        if (rank + 1) * self.rows_per_rank > self.rows:  # padded: already memory of its own
            return _move_owned(local, device)
        if _hands_over_host_memory(local, device):
            return _move_owned(local.clone(), device)
        moved = local.to(device)
        return local.clone() if moved is local else moved  # `.to` hands back its input when no move is needed

    def load_full(self, full: torch.Tensor, comm) -> None:
        """Overwrite this parameter's shard with its rows of `full` (the unwrapped parameter)."""
        single = comm.is_single_controller
        self.load_shard(self.padded(full) if single else self.local_rows(full, comm.layout.shard_rank), comm)

    def load_shard(self, shard: torch.Tensor, comm) -> None:
        """Overwrite the shard (single-controller runtime: the padded global tensor) in place."""
        with torch.no_grad():
            shard = shard.to(self.orig_dtype)
            if comm.is_single_controller:
                self.sharded.data = comm.place_global(shard)  # keeps the Parameter the optimizer holds
            else:
                self.sharded.copy_(shard.to(self.sharded.device))

    def materialize_on(self, comm) -> None:
        """A meta shard (kept by `keep_meta`) -> uninitialized storage on the device, sharded as usual; a new
        parameter object (no optimizer holds the meta one). Created on the device, never on the host."""
        if not self.sharded.is_meta:
            return
        where = "meta" if abstract.active() else comm.device  # meta: a placeholder ([Note: abstract tracing])
        if comm.is_single_controller:
            data = comm.place_global(torch.empty((self.padded_rows, *self.row_shape), dtype=self.orig_dtype,
                                                 device=where))
        else:
            data = abstract.to_device(torch.empty(self.shard_shape, dtype=self.orig_dtype, device=where), comm.device)
        self.sharded = self.param_cls(data, requires_grad=self.requires_grad)
        self.register(self.sharded)

    def unpad(self, padded_rows: torch.Tensor) -> torch.Tensor:
        """(padded_rows, *row_shape) -> the full parameter, a base tensor of its own (the clone), so a saved view of
        it points back to it ([Note: freeing gathered parameters])."""
        return padded_rows[: self.rows].reshape(self.orig_shape).clone()

    def pad_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Full gradient -> (N, shard_numel), ready to be concatenated with the unit's others."""
        g = grad.reshape(self.rows, self.row_numel)
        if self.padded_rows != self.rows:
            g = torch.cat([g, g.new_zeros(self.padded_rows - self.rows, self.row_numel)])
        return g.reshape(self.world, self.shard_numel)

    def register(self, tensor: torch.Tensor) -> None:
        """Put `tensor` at every site (bypasses nn.Module's Parameter-only check on purpose)."""
        for site in self.sites:
            site.module._parameters[site.name] = tensor


ROW_TILE = 16  # bf16 rows of a TPU tile: 8 sublanes, two rows packed in each
MAX_EXTRA = 32  # a shard grows by at most 1/32 of its rows


def _whole_tiles(rows_per_rank: int) -> int:
    """`rows_per_rank` rounded up to whole tiles when that adds at most 1/MAX_EXTRA of them
    ([Note: shards in whole tiles])."""
    extra = -rows_per_rank % ROW_TILE
    return rows_per_rank + extra if extra * MAX_EXTRA <= rows_per_rank else rows_per_rank


# [Note: XLA:CPU shards without a transfer] On XLA:CPU "device" memory is host memory, and `.to(xla)` costs two copies:
# torch_xla stages a contiguous copy of the source, then PJRT copies that into the device buffer asynchronously and
# frees the staging copy later; while the full parameter is alive that is three times the parameter (measured: GPT-2's
# 196 MiB embedding peaked at +590 MiB). Handing PJRT a tensor we own alone through DLPack makes it the device buffer
# without any copy; nothing else may hold it, because XLA may write updated parameters into a donated buffer in place.


def _hands_over_host_memory(tensor: torch.Tensor, device: torch.device) -> bool:
    """True when `tensor` is in host memory and `device` is XLA:CPU."""
    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type != "xla":
        return False
    import torch_xla

    return torch_xla._XLAC._xla_real_devices([str(device)])[0].startswith("CPU")


def _move_owned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host`, which nothing else references, on `device` (see the note above)."""
    if _hands_over_host_memory(host, device):
        from torch_xla.utils.dlpack import from_dlpack

        moved = from_dlpack(host.contiguous())
        if moved.device == torch.device(device):
            return moved
    return host.to(device)
