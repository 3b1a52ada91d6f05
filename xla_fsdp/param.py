"""`FSDPParam`: the record of one sharded parameter.

[Note: dim-0 sharding] A parameter of shape (d0, *rest) is viewed as d0 rows
(a 0-d parameter as one row), padded with zero rows to `rows_per_rank * N`, and
rank r keeps rows [r*rows_per_rank, (r+1)*rows_per_rank). Every rank holds the
same shard shape, so one flat all-gather of the concatenated shards of a unit
rebuilds every parameter. Padding rows carry zero gradients, so optimizers
leave them at zero and norms are unaffected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ParamSite:
    """One place a parameter is registered (tied parameters have several)."""

    module: nn.Module
    name: str
    fqn: str  # relative to the unit's module, for messages


class FSDPParam:
    """Sizes, padding and the local shard of one parameter."""

    def __init__(self, full: torch.Tensor, sites: List[ParamSite], shard_rank: int, shard_world: int,
                 device: torch.device):
        self.sites = sites
        self.orig_shape = full.shape
        self.requires_grad = full.requires_grad
        self.orig_dtype = full.dtype
        self.rows = full.shape[0] if full.dim() > 0 else 1
        self.row_shape: Tuple[int, ...] = tuple(full.shape[1:]) if full.dim() > 0 else ()
        self.row_numel = math.prod(self.row_shape)
        self.world = shard_world
        self.rows_per_rank = max(1, -(-self.rows // shard_world))
        self.padded_rows = self.rows_per_rank * shard_world
        self.shard_shape = (self.rows_per_rank, *self.row_shape)
        self.shard_numel = self.rows_per_rank * self.row_numel
        self.sharded = nn.Parameter(self._local_rows(full, shard_rank).to(device),
                                    requires_grad=self.requires_grad)

    @property
    def fqn(self) -> str:
        return self.sites[0].fqn

    def _local_rows(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        rows = full.detach().reshape(self.rows, *self.row_shape)
        start = rank * self.rows_per_rank
        stop = min(start + self.rows_per_rank, self.rows)
        local = rows[start:stop]
        pad = self.rows_per_rank - max(0, stop - start)
        if pad:
            local = torch.cat([local, rows.new_zeros(pad, *self.row_shape)])
        return local.clone()

    def unpad(self, padded_rows: torch.Tensor) -> torch.Tensor:
        """(padded_rows, *row_shape) -> the full parameter, its own base tensor.

        The clone makes every full parameter a base of its own, so a saved view
        of it points back to it (see [Note: freeing gathered parameters]).
        """
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
