"""The engine's collectives over torch.distributed (gloo on CPU tensors): the same engine trains
across real processes on a machine without accelerators ([Note: rank as data] does not apply:
each process runs eagerly). The interface and the XLA implementations are in collectives.py."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..options import CollectiveOptions, ShardingLayout
from .collectives import REDUCE_SUM, Collectives

_DIST_GROUPS: Dict[Tuple[Tuple[int, ...], ...], List] = {}


def _dist_subgroups(groups: Tuple[Tuple[int, ...], ...]):
    """Process groups for a partition, created once (all ranks must create them in the same order)."""
    import torch.distributed as dist

    if groups not in _DIST_GROUPS:
        _DIST_GROUPS[groups] = [dist.new_group(list(g)) for g in groups]
    return _DIST_GROUPS[groups]


class DistCollectives(Collectives):
    """torch.distributed collectives (gloo on CPU). XLA-only mechanics are no-ops here."""

    def __init__(self, layout: ShardingLayout, options: CollectiveOptions, device=None):
        import torch.distributed as dist

        self._dist = dist
        self.layout = layout
        self.options = options
        self.device = device if device is not None else torch.device("cpu")
        self._pg = {"shard": self._process_group(layout.shard_groups),
                    "replicate": self._process_group(layout.replicate_groups), "world": None}  # the default group

    def _size(self, group) -> int:
        if isinstance(group, tuple):
            return len(next(g for g in group if self.layout.rank in g))
        return {"shard": self.layout.shard_world_size, "replicate": self.layout.replicate_world_size,
                "world": self.layout.world_size}[group]

    def _process_group(self, group):
        if isinstance(group, tuple):
            pgs = _dist_subgroups(group)
            return pgs[next(i for i, g in enumerate(group) if self.layout.rank in g)]
        return self._pg[group]

    def all_gather(self, flat_shard):
        n = self._size("shard")
        if n == 1:
            return flat_shard
        parts = [torch.empty_like(flat_shard) for _ in range(n)]
        self._dist.all_gather(parts, flat_shard.contiguous(), group=self._pg["shard"])
        return torch.cat(parts)

    def reduce_scatter(self, flat, follow_chain=True):
        n = self._size("shard")
        if n == 1:
            return flat
        # gloo has no reduce-scatter; all-reduce then keep our chunk (same result, 2x bytes)
        total = flat.contiguous().clone()
        self._dist.all_reduce(total, group=self._pg["shard"])
        return total.view(n, -1)[self.layout.shard_rank].clone()

    def all_reduce(self, tensor, group, op=REDUCE_SUM):
        if self._size(group) == 1:
            return tensor
        out = tensor.contiguous().clone()
        red = self._dist.ReduceOp.SUM if op == REDUCE_SUM else self._dist.ReduceOp.MAX
        self._dist.all_reduce(out, op=red, group=self._process_group(group))
        return out

    def barrier(self):
        self._dist.barrier()

    def all_ok(self, ok):
        return bool(self.smallest(1 if ok else 0))

    def smallest(self, n):
        value = torch.tensor([int(n)], dtype=torch.int64)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MIN)
        return int(value.item())
