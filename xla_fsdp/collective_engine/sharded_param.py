"""`ShardedParameter`: what FSDP2 scripts touch on a parameter, on the single controller.

[Note: FSDP2 parameters on XLA] FSDP2 makes every parameter a DTensor sharded
on dim 0. On torch_xla 2.9 a DTensor cannot be a parameter that computes
(torch_xla's XLAShardedTensor fails in mm/linear/layer_norm, and per-process
DTensors fail in dispatch; ../shared/notes/fsdp2-on-xla.md). Here a parameter
is what the single controller already holds: one global XLA tensor, sharded
on dim 0 over the mesh, padded on dim 0 to a multiple of the device count
when the rows do not divide ([Note: dim-0 sharding]). This subclass of
`nn.Parameter` adds DTensor's surface: `placements` (`(Shard(0),)`),
`device_mesh`, `full_tensor()` (the unpadded whole parameter, differentiable)
and `to_local()` (what this process holds: on one host, every device's rows).
Its `shape` is the global tensor's, which is the parameter's own shape unless
padding was needed; `full_shape` is always the parameter's own. Every op on it
is a plain tensor op (the subclass does not intercept dispatch), so
optimizers, `clip_grad_norm_` and `torch.nn.init` work as on any tensor.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn


class ShardedParameter(nn.Parameter):
    """A dim-0 sharded global parameter with FSDP2's DTensor attributes (see the note above)."""

    def __new__(cls, data: Optional[torch.Tensor] = None, requires_grad: bool = True):
        return super().__new__(cls, data, requires_grad)

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

    @property
    def placements(self):
        return placements_on(self._device_mesh)

    @property
    def device_mesh(self):
        return self._device_mesh

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
        """The rows this process holds: on the single controller every device of the host is this
        process's, so that is the whole (padded) global tensor; differentiable like DTensor's."""
        return self.view_as(self)

    def __repr__(self) -> str:
        return (f"ShardedParameter(shape={tuple(self.full_shape)}, placements={self.placements}, "
                f"mesh={self._device_mesh}, dtype={self.dtype})")


def placements_on(device_mesh) -> tuple:
    """FSDP2's placements on `device_mesh`: `(Shard(0),)`, or `(Replicate(), Shard(0))` on an HSDP mesh."""
    from torch.distributed.tensor import Replicate, Shard

    ndim = getattr(device_mesh, "ndim", 1)
    return (Replicate(),) * (ndim - 1) + (Shard(0),)
