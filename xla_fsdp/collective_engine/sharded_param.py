"""`ShardedParameter`: what FSDP2 scripts touch on a parameter, on the single controller.

[Note: FSDP2 parameters on XLA] FSDP2 makes every parameter a DTensor sharded on dim 0. On torch_xla 2.9 a DTensor
cannot be a parameter that computes (torch_xla's XLAShardedTensor fails in mm/linear/layer_norm, and per-process
DTensors fail in dispatch; ../shared/notes/fsdp2-on-xla.md). Here a parameter is what the single controller already
holds: one global XLA tensor sharded on dim 0 over the mesh, padded to a multiple of the device count when the rows do
not divide ([Note: dim-0 sharding]). This `nn.Parameter` subclass does not intercept dispatch: every op on it is a
plain op on the global tensor (optimizers, `clip_grad_norm_` and `torch.nn.init` work as on any tensor). It has
DTensor's surface (`placements`: `(Shard(0),)`, or `(Replicate(), Shard(0))` under HSDP; `device_mesh`, `full_tensor()`,
`to_local()`) but is no `DTensor` for `isinstance`: torch's DCP treats a DTensor parameter as one local shard per
process (`set_model_state_dict(..., broadcast_from_rank0=True)` slices the full tensor by the process's mesh
coordinate), which one process holding every device's rows is not. The padding stays out of sight: `shape`, `size()`,
`numel()` and `len()` give the parameter's own global shape, and `copy_` from a tensor of that shape writes its rows.
Ops see the stored (padded) tensor, so gradients and optimizer state have the stored shape (`stored_shape`), which the
state dicts cut back ([Note: state dicts of the single controller]).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn


class ShardedParameter(nn.Parameter):
    """A dim-0 sharded global parameter with FSDP2's DTensor attributes (see the note above)."""

    def bind(self, record, device_mesh) -> "ShardedParameter":
        """Attach the engine's record of this parameter and the mesh it is sharded over."""
        self._record = weakref.ref(record)
        self._device_mesh = device_mesh
        return self

    def _rec(self):
        rec = getattr(self, "_record", None)
        rec = rec() if rec is not None else None
        if rec is None:
            raise RuntimeError("this ShardedParameter is no longer registered by fully_shard (its module was "
                               "dropped or re-sharded)")
        return rec

    # -- DTensor's surface ----------------------------------------------------------------------
    @property
    def placements(self):
        return placements_on(self._device_mesh)

    @property
    def device_mesh(self):
        return self._device_mesh

    @property
    def shape(self) -> torch.Size:
        """The parameter's own global shape (padding rows are not counted)."""
        return self.full_shape

    def size(self, dim: Optional[int] = None):
        return self.full_shape if dim is None else self.full_shape[dim]

    def numel(self) -> int:
        return self.full_shape.numel()

    def __len__(self) -> int:
        return self.full_shape[0]

    @property
    def full_shape(self) -> torch.Size:
        """The parameter's own (unpadded) shape."""
        return torch.Size(self._rec().orig_shape)

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter (padding rows cut off), differentiable like DTensor's."""
        rec = self._rec()
        whole = torch.Tensor.__getitem__(self, slice(0, rec.rows))
        return whole.reshape(rec.orig_shape)

    def to_local(self) -> torch.Tensor:
        """The rows this process holds: on the single controller the whole parameter (padding rows cut off)."""
        return self.full_tensor()

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> "ShardedParameter":
        """In-place copy; a source of the parameter's own shape fills its rows (the padding rows become zeros), one of
        the stored shape is copied as it is, the parameter itself not at all (a load that set its data already:
        [Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py)."""
        if src is self:
            return self
        rec = self._rec()
        if tuple(src.shape) == tuple(rec.orig_shape) and tuple(src.shape) != tuple(stored_shape(self)):
            src = rec.padded(src)
        return torch.Tensor.copy_(self, src, non_blocking)

    def redistribute(self, *args, **kwargs):
        raise NotImplementedError("ShardedParameter.redistribute: a fully_shard parameter stays sharded on dim 0 "
                                  "over its mesh; use full_tensor() for the whole parameter")

    def __repr__(self) -> str:
        return (f"ShardedParameter(shape={tuple(self.full_shape)}, placements={self.placements}, "
                f"mesh={self._device_mesh}, dtype={self.dtype})")


def stored_shape(t: torch.Tensor) -> torch.Size:
    """The shape of the tensor as stored: for a `ShardedParameter`, padding rows included."""
    return torch.Tensor.size(t)


def placements_on(device_mesh) -> tuple:
    """FSDP2's placements on `device_mesh`: `(Shard(0),)`, or `(Replicate(), Shard(0))` on an HSDP mesh."""
    from torch.distributed.tensor import Replicate, Shard

    ndim = getattr(device_mesh, "ndim", 1)
    return (Replicate(),) * (ndim - 1) + (Shard(0),)
