"""What an SPMD host holds of a global tensor, in rows of the full tensor, and how it writes and reads back only those
rows (the single controller and the GSPMD engine, one host or a pod).

Under the SPMD runtimes every parameter and optimizer state is one global XLA tensor sharded over the devices of every
host. A host can read (and must write) only the shards on its own devices (`xla_fsdp.runtime.hosts.HostView`):
`torch_xla._XLAC._get_local_shards` gives their data, and `_get_local_shard_replica_and_indices` which rows of the
global tensor each one is and which copy (replica) of those rows it is.

[Note: who writes a row] Rows that several devices hold (a mesh with a replica axis, i.e. HYBRID sharding, or a
replicated tensor) are written once: the block of rows starting at shard row b (b = start // shard rows) is written by
the device holding replica b mod R, R the number of copies (read off the tensor's sharding, the same on every host).
Every host computes the same choice from the sharding alone, so no host writes a row another writes, no exchange is
needed, and with the replica axis across hosts the writes alternate between them. Unlike torch_xla's own SPMD
checkpointing, which dedups copies per host and can drop rows two local devices hold, every block has exactly one
writer.

Loading builds each of this host's device shards from the rows it needs (padding rows zero), and hands them to torch_xla
with the target's sharding (`_global_tensor_from_cpu_shards`): a pod host gives only its own devices' shards; a virtual
host ([Note: virtual hosts]) gets the other blocks' from the other processes. Only dim-0 sharding is supported (every
engine of ours shards dim 0); anything else is refused by name."""
from __future__ import annotations

import math
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..runtime import hosts
from ..runtime.hosts import HostGroup, HostView
from ..collective_engine.sharded_param import stored_shape

Piece = Tuple[int, int, Callable[[], torch.Tensor]]  # [start, stop) of the full tensor's rows, produce rows
_TILES = re.compile(r"devices=\[([0-9,]+)\]")  # a tiled sharding spec's tile counts per dim


def is_sharded(tensor: torch.Tensor) -> bool:
    import torch_xla

    return tensor.device.type == "xla" and bool(torch_xla._XLAC._get_xla_sharding_spec(tensor))


def copies(tensor: torch.Tensor) -> int:
    """How many devices hold each row block of a sharded tensor (R in [Note: who writes a row])."""
    import torch_xla
    import torch_xla.runtime as xr

    spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    devices = xr.global_runtime_device_count()
    if "replicated" in spec and "devices=" not in spec:
        return devices
    m = _TILES.search(spec)
    if m is None:
        raise NotImplementedError(f"sharding {spec} is not a tiled or replicated sharding; checkpoints of SPMD "
                                  "runs support tensors sharded on dim 0 (any mesh, replica axes included)")
    tiles = [int(x) for x in m.group(1).split(",")]
    if "last_tile_dim_replicate" in spec:
        tiles = tiles[:-1]
    elif "last_tile_dims" in spec:
        raise NotImplementedError(f"sharding {spec}: subgroup shardings other than a replicated last tile "
                                  "dim are not supported by checkpoints")
    return devices // math.prod(tiles)


def _dim0(name: str, index) -> Tuple[int, int]:
    """[start, stop) of dim 0 from a shard's indices; the other dims must be whole."""
    if not isinstance(index, (list, tuple)):  # a replicated tensor's shard is the whole tensor
        return 0, -1
    for dim, s in enumerate(index[1:], start=1):
        if not (isinstance(s, slice) and s.start in (0, None) and s.step in (1, None)):
            raise NotImplementedError(f"{name} is sharded on dim {dim} ({index}); checkpoints of SPMD runs "
                                      "support sharding on dim 0 only")
    s = index[0]
    return s.start, s.stop


def _merged(pieces: List[Piece]) -> List[Piece]:
    """Adjacent pieces as one (a host's devices usually hold consecutive blocks)."""
    pieces.sort(key=lambda p: p[0])
    runs: List[List] = []
    for start, stop, produce in pieces:
        if runs and runs[-1][1] == start:
            runs[-1][1] = stop
            runs[-1][2].append(produce)
        else:
            runs.append([start, stop, [produce]])
    return [(a, b, (lambda parts=parts: torch.cat([p() for p in parts]) if len(parts) > 1 else parts[0]()))
            for a, b, parts in runs]


def pieces_to_write(name: str, tensor: torch.Tensor, rows: int, view: HostView) -> List[Piece]:
    """The rows [0, rows) of `tensor` (dim 0 may be padded beyond `rows`) that this host writes, moved to host memory
    only when their turn to be written comes ([Note: one tensor in host memory at a time])."""
    if tensor.dim() == 0 or not is_sharded(tensor):
        # replicated: the first host writes it whole
        if view.index != 0:
            return []
        whole = lambda: tensor.detach().cpu().reshape(-1)[:1] if tensor.dim() == 0 else tensor.detach().cpu()[:rows]
        return [(0, max(rows, 1) if tensor.dim() == 0 else rows, whole)]
    # which rows each device holds, from the sharding alone: nothing moves yet
    where = _shard_indices(tensor)
    spans = [_dim0(name, index) for _, index in where]
    shard_rows = max(tensor.shape[0] if stop < 0 else stop - start for start, stop in spans)
    replicas = copies(tensor)
    writes = []  # (start, stop, the device's position in the process's devices)
    for position, (device, (replica, _), (start, stop)) in enumerate(zip(view.all_devices, where, spans)):
        if not view.owns(device):
            continue
        stop = rows if stop < 0 else min(stop, rows)
        if start >= stop or replica != (start // max(shard_rows, 1)) % replicas:
            continue  # a block of padding only, or another copy of these rows is written ([Note: who writes a row])
        writes.append((start, stop, position))
    moved = _Moved(tensor, [position for _, _, position in writes], view)
    return _merged([(a, z, lambda i=i, n=z - a: moved.rows(i, n)) for a, z, i in writes])


class _Moved:
    """The shards of one tensor that this host writes, in host memory from the first of its pieces' turn to the last's.

    [Note: one tensor in host memory at a time] torch_xla moves a tensor's shards to the host only all at once
    (`_get_local_shards`: every device of the process, copies included; 2.9 has no call for some devices only).
    Moving each tensor when its pieces are written, keeping only the shards this host writes and letting go of them
    once written, holds at most one tensor's local shards in host memory, not the host's whole share of model and
    optimizer."""

    def __init__(self, tensor: torch.Tensor, positions: List[int], view: HostView):
        self._tensor = tensor
        self._keep = set(positions)
        self._left = len(positions)
        self._view = view
        self._shards: Optional[Dict[int, torch.Tensor]] = None

    def rows(self, position: int, count: int) -> torch.Tensor:
        """The first `count` rows of the shard of the device at `position`."""
        if self._shards is None:
            import torch_xla

            shards = torch_xla._XLAC._get_local_shards([self._tensor])[0]
            if [device for _, device in shards] != list(self._view.all_devices):
                raise RuntimeError(f"torch_xla listed the shards of a tensor on {[d for _, d in shards]}, expected "
                                   f"this process's devices {list(self._view.all_devices)} in order")
            # the copies this host does not write are let go at once
            self._shards = {i: data for i, (data, _) in enumerate(shards) if i in self._keep}
        out = self._shards[position][:count]
        self._left -= 1
        if self._left == 0:
            self._shards = None
        return out


def _shard_indices(tensor: torch.Tensor):
    """torch_xla's (replica, indices) per local shard of `tensor`. It reads the tensor's device data, which a step still
    in flight (torch_xla.sync() returns before the device finishes) has not produced yet: "Trying to access XLA data ...
    while an async operation is in flight". Waiting for the device first is cheap when it is idle."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    return torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]


def device_rows(like: torch.Tensor) -> List[Tuple[int, int, int]]:
    """For each device the process drives (runtime order): ([start, stop) of dim 0 of `like`'s global shape it holds,
    its padded shard rows), from `like`'s sharding."""
    import torch_xla
    import torch_xla.runtime as xr

    where = _shard_indices(like)
    spec = torch_xla._XLAC._get_xla_sharding_spec(like)
    m = _TILES.search(spec)
    tiles0 = int(m.group(1).split(",")[0]) if m else 1
    total = stored_shape(like)[0]
    shard_rows = -(-total // tiles0)
    spans = [_dim0("tensor", index) for _, index in where]
    out = [(start, total if stop < 0 else stop, shard_rows) for start, stop in spans]
    if len(out) != xr.addressable_runtime_device_count():
        raise RuntimeError(f"torch_xla reported {len(out)} shards for {xr.addressable_runtime_device_count()} devices")
    return out


class ShardReader:
    """Builds global tensors with a given sharding from rows read for this host's devices only."""

    def __init__(self, view: HostView, group: HostGroup):
        self.view = view
        self.group = group

    def shards(self, like: torch.Tensor, rows: int, read: Callable[[int, int], torch.Tensor],
               dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """{device: shard} for this host's devices: the true rows [0, rows) of the tensor read with read(start, stop)
        (each distinct block once), padding rows zero."""
        cache: Dict[Tuple[int, int], torch.Tensor] = {}
        out = {}
        for device, (start, stop, shard_rows) in zip(self.view.all_devices, device_rows(like)):
            if not self.view.owns(device):
                continue
            real = max(0, min(stop, rows) - start)
            key = (start, start + real)
            if key not in cache:
                cache[key] = read(start, start + real).to(dtype) if real else None
            shard = torch.zeros((shard_rows, *like.shape[1:]), dtype=dtype)
            if real:
                shard[:real] = cache[key]
            out[device] = shard
        return out

    def place(self, like: torch.Tensor, shards: Dict[str, torch.Tensor]) -> torch.Tensor:
        """A new global tensor of `like`'s shape and sharding from {device: shard}."""
        import torch_xla

        return hosts.global_tensor(shards, torch_xla._XLAC._get_xla_op_sharding(like), stored_shape(like), self.view,
                                   self.group)
