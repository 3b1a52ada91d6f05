"""The reduce-scatter and the all-gather as rings of neighbour exchanges ([Note: ring reduce-scatter]).

[Note: ring reduce-scatter]
libtpu never runs a reduce-scatter asynchronously (the gradient reduce-scatters block the TensorCore), but it runs
collective-permutes asynchronously, with matmuls between start and done. A reduce-scatter over k devices is k-1 such
permutes around a ring: the device at ring position p starts from its chunk p-1, and at each step passes what it holds
to p+1 and adds its own copy of the chunk it received, so after k-1 steps it holds chunk p summed over the ring; each
device sends (k-1)/k of the buffer. On a torus, one ring per axis, slowest axis first (torus.py's stages), leaves device
(z, y, x) with chunk z*Y*X + y*X + x: the flat reduce-scatter's result.

torch_xla 2.9's `collective_permute` carries no channel id, so inside our one SPMD program its pairs would name replicas
(libtpu aborts on such a module). The GSPMD partitioner, though, turns a rotation of a tensor sharded along a mesh axis
(a concatenation of its last slice and the rest) into one collective-permute with a channel id over that axis. So each
step leaves the manual region for the rotation and comes back (the custom calls at the border move no data). Chunk
choices depend on the device's coordinate: each device reads its row of a small table of chunk orders as data ([Note:
rank as data]), and each step takes its chunk by a one-index gather (a dynamic slice fused into the add); one gather of
all k chunks per ring copied whole buffers, and libtpu split it into thousands of small gathers.

The all-gather (`all_gather_impl="ring"`) is the same rings run backwards, fastest axis first: each step passes on
what a device received last, and one-index gathers concatenate the received chunks in device order.

[Note: rings within each slice]
On a job of several slices (HSDP: one shard group per slice, [Note: HSDP across slices] in runtime/slices.py) the
rings run within each slice, every slice's at once: the ring mesh gains an outer axis over the slices, along which
nothing rotates, so each permute's pairs stay inside a slice (ICI) and each slice's devices read the same orders.

[Note: a trip's slice, held]
A scanned loop's trip gathers the next layer from its slice of the stored stacks, and the ring reads that slice twice:
its first send, and this device's own rows of the gathered weight. libtpu may then compute the slice once per reader
(with the loop's indices in s32, [Note: the loop's 32-bit indices] in region_loop.py, it did: 4 GB more HBM traffic a
step for the 2B GPT-2). So the trips (scan_loop.py) pass the slices through the engine's optimization barrier.

[Note: ring gathers in the shard's shape]
A parameter gathered alone ([Note: gathering rows]) traveling flat would be copied into a 1-D buffer viewed as [n, 128]
and back into [rows * N, cols]: on a TPU both are relayouts (a 2-D array's (8, 128) tiles hold 8 rows of 128 columns,
the flat view's 1024 consecutive elements), two copies of every gathered weight per gather. When the shard is whole
tiles (its last dim a multiple of 128, its rows of 8 for 32-bit and 16 for 16-bit types) the ring passes it in its own
shape and concatenates the received shards along dim 0, where whole tiles line up: no copy (measured: 2B GPT-2 on v4-8,
19.05 -> 17.43 GiB). The reduce-scatter rings stay flat: in their shape they were slower and no faster to compile.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

from .conversions import to_global, to_local

AXES = ("ring_z", "ring_y", "ring_x")
SLICE_AXIS = "ring_slice"
LANES = 128  # a TPU vector register's lanes: the minor dimension of every buffer on a ring
TILE = 8 * LANES  # elements of one (8, 128) tile: a 1-D array of a multiple of it views as rows for free


def ring_axes(shape: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(mesh dim, devices along it, device-id stride) per ring of a torus `shape` (X, Y, Z), slowest axis first; axes of
    length 1 have none."""
    return [(2 - axis, shape[axis], math.prod(shape[:axis])) for axis in (2, 1, 0) if shape[axis] > 1]


def _orders(shape: Sequence[int], axes, per_ring) -> np.ndarray:
    """[devices, sum of ring lengths]: per device, `per_ring(position, k)` for each ring of `axes`."""
    rows = [[i for _, k, stride in axes for i in per_ring((device // stride) % k, k)]
            for device in range(math.prod(shape))]
    return np.asarray(rows, dtype=np.int32)  # TPUs emulate 64-bit integers


def chunk_orders(shape: Sequence[int]) -> np.ndarray:
    """Per device and ring, the order in which it adds its chunks. At ring position p: chunk p-1 first, then p-2, ...,
    its own chunk p last."""
    return _orders(shape, ring_axes(shape), lambda p, k: [(p - 1 - s) % k for s in range(k)])


def gather_orders(shape: Sequence[int]) -> np.ndarray:
    """Per device and ring (fastest axis first, the order the all-gather walks them), where chunk c sits among what it
    received: at ring position p, after s steps it holds its predecessor-by-s's chunk p-s, so chunk c arrived at step
    p-c."""
    return _orders(shape, list(reversed(ring_axes(shape))), lambda p, k: [(p - c) % k for c in range(k)])


class TorusRings:
    """Reduce-scatters and all-gathers over every device of a slice of `shape` (x first; device id x + X*(y + Y*z)), one
    ring per axis longer than 1. Buffers travel as rows of LANES: a 1-D array whose length is a multiple of TILE is the
    same bytes as its [rows, LANES] view on a TPU, while a 1-D array viewed as [k, m] or [1, 1, 1, m] is copied into
    another tiling, and libtpu takes minutes to compile each such copy of a large buffer. So each device's chunk is
    zero-padded to a multiple of TILE once, and every view the ring takes after that only adds or splits leading
    dimensions."""

    def __init__(self, shape: Sequence[int], slices: int = 1):
        import torch_xla.distributed.spmd as xs

        shape = tuple(shape) + (1,) * (3 - len(shape))
        if len(shape) != 3:
            raise ValueError(f"a torus of at most three axes, not {shape}")
        self.shape = shape  # (X, Y, Z)
        self.devices = math.prod(shape)  # of one slice: a ring never leaves its slice
        self.slices = slices
        grid = tuple(reversed(shape))  # (Z, Y, X): row-major over device ids
        if slices == 1:
            self._axes, self._dims = AXES, (0, 1, 2)
            self.mesh = xs.Mesh(np.arange(self.devices), grid, AXES)
            return
        # [Note: rings within each slice]: an outer mesh axis over the slices (consecutive blocks of device ids), along
        # which nothing rotates; the torus axes of one device are left out, as torch_xla shards at most 5 dims
        kept = [d for d in range(3) if grid[d] > 1]
        self._axes = (SLICE_AXIS,) + tuple(AXES[d] for d in kept)
        self._dims = tuple(kept.index(d) + 1 if d in kept else -1 for d in range(3))
        self.mesh = xs.Mesh(np.arange(self.devices * slices), (slices,) + tuple(grid[d] for d in kept), self._axes)

    def axes(self) -> List[Tuple[int, int, int]]:
        return ring_axes(self.shape)

    def orders(self) -> np.ndarray:
        """Each device's row: its reduce-scatter chunk orders, then its all-gather ones (every slice's devices alike)."""
        one = np.concatenate([chunk_orders(self.shape), gather_orders(self.shape)], axis=1)
        return np.tile(one, (self.slices, 1))

    def _rotate(self, held: torch.Tensor, dim: int, step) -> torch.Tensor:
        """Each device's `held` ([rows, LANES], or a shard of rows in its own shape) -> the one held by its predecessor
        along mesh dim `dim` (of the torus); `step`: _summing_step or _gathering_step."""
        shape = held.shape
        if len(self._axes) + held.dim() > 5:  # torch_xla's limit: the rows travel flat
            held = held.reshape(-1)
        dim = self._dims[dim]
        spec = self._axes + (None,) * held.dim()
        glob = to_global(held.view(*(1,) * len(self._axes), *held.shape), self.mesh, spec,
                         torch.Size(tuple(self.mesh.mesh_shape) + tuple(held.shape)))
        k = glob.shape[dim]
        turned = step([glob.narrow(dim, k - 1, 1), glob.narrow(dim, 0, k - 1)], dim)
        return to_local(turned, self.mesh, spec).view(shape)

    def reduce_scatter(self, flat: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """`flat` (1-D, a multiple of the device count) -> this device's chunk, summed over every device. `order`:
        this device's row of `orders()` (data, any shape)."""
        order = order.reshape(-1)
        chunk = flat.numel() // self.devices
        padded = _padded(chunk)
        out, start = _pad_chunks(flat, self.devices, chunk, padded).view(-1, LANES), 0
        for dim, k, _ in self.axes():
            chunks = out.view(k, -1, LANES)
            held = _pick(chunks, order, start)
            for step in range(1, k):
                held = self._rotate(held, dim, _summing_step) + _pick(chunks, order, start + step)
            start += k
            out = held
        out = out.reshape(-1)
        return out if padded == chunk else out[:chunk]

    def all_gather(self, shard: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """This device's `shard` (1-D) -> every device's, concatenated in device-id order (the reduce-scatter run
        backwards: fastest axis first). `order`: as for reduce_scatter."""
        chunk = shard.numel()
        padded = _padded(chunk)
        out = self.all_gather_rows(_pad_chunks(shard, 1, chunk, padded).view(-1, LANES), order).reshape(-1)
        return out if padded == chunk else torch.cat([out.narrow(0, d * padded, chunk) for d in range(self.devices)])

    def all_gather_rows(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """This device's shard of rows ([rows, ...]) -> every device's, stacked along dim 0 in device-id order, each
        step's buffers in the shard's own shape ([Note: ring gathers in the shard's shape]). `order`: as above."""
        order = order.reshape(-1)
        out = rows
        start = sum(k for _, k, _ in self.axes())
        for dim, k, _ in reversed(self.axes()):
            received = [out]
            for _ in range(1, k):
                received.append(self._rotate(received[-1], dim, _gathering_step))
            stacked = torch.stack(received)
            out = torch.cat([_pick(stacked, order, start + c) for c in range(k)])
            start += k
        return out


# [Note: which ring a permute belongs to]
# Both rings move data with the same rotation, which the partitioner turns into one collective-permute per step.
# torch_xla writes the Python line that issued each op into the program's metadata (XLA_HLO_DEBUG=1, as the check
# traces), so each ring issues its rotation from a function of its own, and the check (xla_fsdp/tpu/hlo_source.py's
# RING_STEPS, which names these two) tells a gradient's permute from a parameter's.
def _summing_step(parts, dim: int) -> torch.Tensor:
    return torch.cat(parts, dim)


def _gathering_step(parts, dim: int) -> torch.Tensor:
    return torch.cat(parts, dim)


def _pick(chunks: torch.Tensor, order: torch.Tensor, at: int) -> torch.Tensor:
    """chunks[order[at]]: one slab of [k, rows, LANES] chosen by data, a one-index gather ([Note: ring reduce-scatter])."""
    return chunks.index_select(0, order.narrow(0, at, 1)).view(chunks.shape[1:])


def whole_tiles(shape: Sequence[int], itemsize: int) -> bool:
    """Whether a shard of rows of `shape` is whole (8, LANES) tiles of 32-bit words (16 rows of bf16): then a ring can
    gather it in its own shape ([Note: ring gathers in the shard's shape])."""
    return len(shape) >= 2 and shape[-1] % LANES == 0 and shape[-2] % (8 * max(1, 4 // itemsize)) == 0


def _padded(chunk: int) -> int:
    return -(-chunk // TILE) * TILE


def _pad_chunks(flat: torch.Tensor, count: int, chunk: int, padded: int) -> torch.Tensor:
    """1-D `flat` of `count` chunks -> each zero-padded to `padded`, still 1-D (see TorusRings)."""
    if padded == chunk:
        return flat
    zeros = flat.new_zeros(padded - chunk)
    return torch.cat([piece for d in range(count) for piece in (flat.narrow(0, d * chunk, chunk), zeros)])
