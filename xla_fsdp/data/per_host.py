"""Per-host data under the SPMD runtimes: which rows of a global batch this host reads, and the global XLA tensor built
from those rows alone.

[Note: per-host batches] Under the SPMD runtimes one process per host drives its chips and every host runs one program,
whose batch is one global tensor sharded on dim 0 over every mesh axis (`xla_fsdp.runtime.mesh.batch_spec`). Tile t of
that sharding (rows [t*s, (t+1)*s), s = ceil(B / T) for a global batch of B rows and T devices; XLA pads the last tiles)
lives on the device at flat position t of the mesh's logical device grid (`mesh.get_logical_mesh()`, axes in the mesh's
order: the order torch_xla's tile assignment uses for a dim split over all axes). A host therefore needs only the tiles
of its own devices (`xla_fsdp.runtime.hosts.HostView.devices`): for an arbitrary mesh these need not be contiguous (a
mesh built from sharding groups [[0, 2], [1, 3]] puts devices 0 and 1, one host, on tiles 0 and 2). `host_rows` lists
them in ascending row order (= the mesh's tile order).

`HostBatches.to_global(local)` builds the global tensor from this host's rows: each of its devices' tile (padded with
zeros to s rows) goes to `torch_xla._XLAC._global_tensor_from_cpu_shards` with the batch sharding. A virtual host
([Note: virtual hosts] in xla_fsdp/runtime/hosts.py) drives every device but holds only its own rows, so it gets the
other hosts' shards through `HostGroup.exchange` first. One (real) host copies the whole batch to the device and
annotates it with `xs.mark_sharding`.

In a user's loop (every host runs the same code, with the same seeded order of global batches):

    hb = HostBatches(mesh)                       # after xr.use_spmd()
    rows = hb.rows(global_batch)                 # positions in each global batch this host reads
    for step_rows in sampler:                    # indices of one global batch, same on every host
        local = dataset[step_rows[rows]]         # read only this host's rows
        batch = hb.to_global(local)              # the [global_batch, ...] XLA tensor, batch-sharded
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..runtime.hosts import HostGroup, HostView, device_ordinal, global_tensor, host_view


def tile_rows(global_batch: int, tiles: int) -> List[Tuple[int, int]]:
    """[start, stop) of the rows of each of `tiles` dim-0 tiles of a `global_batch`-row tensor, as XLA tiles it
    (ceil-sized tiles; the last ones short or empty: padding only)."""
    if global_batch < 1 or tiles < 1:
        raise ValueError(f"a global batch of {global_batch} rows over {tiles} devices: both must be >= 1")
    size = -(-global_batch // tiles)
    return [(min(t * size, global_batch), min((t + 1) * size, global_batch)) for t in range(tiles)]


def device_rows(global_batch: int, logical_mesh) -> Dict[int, Tuple[int, int]]:
    """{device id: [start, stop)} of the batch rows each device of the mesh holds under the batch sharding;
    `logical_mesh` is the mesh's device-id grid (`mesh.get_logical_mesh()`)."""
    ids = [int(d) for d in np.asarray(logical_mesh).reshape(-1)]
    return dict(zip(ids, tile_rows(global_batch, len(ids))))


def host_rows(global_batch: int, logical_mesh, host_device_ids: Sequence[int]) -> List[int]:
    """The rows of a global batch the devices `host_device_ids` hold, ascending (the mesh's tile order); every row once.
    Across hosts that partition the devices, every row is read once."""
    held = device_rows(global_batch, logical_mesh)
    missing = sorted(set(int(d) for d in host_device_ids) - set(held))
    if missing:
        raise ValueError(f"devices {missing} of this host are not in the mesh (devices {sorted(held)})")
    spans = sorted(held[int(d)] for d in host_device_ids)
    return [row for start, stop in spans for row in range(start, stop)]


class HostBatches:
    """This host's share of global batches laid out with the batch sharding of `mesh` ([Note: per-host batches]). Under
    the SPMD runtime only (`xr.use_spmd()`)."""

    def __init__(self, mesh, view: Optional[HostView] = None, group: Optional[HostGroup] = None):
        self.mesh = mesh
        self.view = view or host_view()
        self._group = group
        self._grid = np.asarray(mesh.get_logical_mesh())
        self._ids = [device_ordinal(d) for d in self.view.devices]
        self._rows: Dict[int, torch.Tensor] = {}

    @property
    def single(self) -> bool:
        """One host that is not a virtual one: it reads every row, and `to_global` is today's whole-batch copy."""
        return self.view.is_single and not self.view.virtual

    def rows(self, global_batch: int) -> torch.Tensor:
        """The positions (0..global_batch-1, ascending) of the rows this host reads of every global batch of
        `global_batch` rows (a LongTensor to index with)."""
        if global_batch not in self._rows:
            self._rows[global_batch] = torch.tensor(host_rows(global_batch, self._grid, self._ids), dtype=torch.long)
        return self._rows[global_batch]

    def select(self, global_rows: torch.Tensor) -> torch.Tensor:
        """This host's rows of a whole global batch held on the host (for sources that cannot read rows selectively;
        prefer reading only `rows(...)`)."""
        return global_rows[self.rows(global_rows.shape[0])]

    def global_size(self, local_rows: int) -> int:
        """The global batch whose share for this host is `local_rows` rows, when every device holds the same number of
        rows (pass the global size to `to_global` otherwise)."""
        if self.single:
            return local_rows
        tiles, mine = int(self._grid.size), len(self._ids)
        if (local_rows * tiles) % mine == 0:
            size = local_rows * tiles // mine
            if size % tiles == 0 and len(self.rows(size)) == local_rows:
                return size
        raise ValueError(f"{local_rows} rows on this host's {mine} of {tiles} devices is no global batch split "
                         f"evenly; pass global_batch= to to_global")

    def to_global(self, local: torch.Tensor, global_batch: Optional[int] = None) -> torch.Tensor:
        """The [global_batch, ...] XLA tensor, sharded on dim 0 over every mesh axis, from this host's rows `local` (a
        host tensor: `rows(global_batch)` of the global batch, in that order)."""
        import torch_xla
        import torch_xla.distributed.spmd as xs

        from ..runtime.mesh import batch_spec

        spec = batch_spec(local, self.mesh)
        if self.single:  # today's path, unchanged
            batch = local.to(torch_xla.device())
            xs.mark_sharding(batch, self.mesh, spec)
            return batch
        size = self.global_size(local.shape[0]) if global_batch is None else int(global_batch)
        want = len(self.rows(size))
        if local.shape[0] != want:
            raise ValueError(f"this host reads {want} rows of a global batch of {size}; got {local.shape[0]}")
        return global_tensor(self._shards(local.detach().cpu(), size), self.mesh.get_op_sharding(spec),
                             [size, *local.shape[1:]], self.view, self._group)

    def _shards(self, local: torch.Tensor, size: int) -> Dict[str, torch.Tensor]:
        """{device: its tile of the batch, zero-padded to the tile size} for this host's devices."""
        held = device_rows(size, self._grid)
        tile = -(-size // int(self._grid.size))
        spans = sorted(held[i] for i in self._ids)  # `local` is in this order
        offset = dict(zip(spans, itertools.accumulate((stop - start for start, stop in spans), initial=0)))
        out = {}
        for device, i in zip(self.view.devices, self._ids):
            start, stop = held[i]
            part = local[offset[(start, stop)]:offset[(start, stop)] + stop - start]
            if part.shape[0] < tile:
                part = torch.cat([part, part.new_zeros((tile - part.shape[0], *local.shape[1:]))])
            out[device] = part.contiguous()
        return out
