"""The reduce-scatter as rings of neighbour exchanges ([Note: ring reduce-scatter]).

[Note: ring reduce-scatter]
libtpu 0.0.21 never runs a reduce-scatter asynchronously: whatever its flags, the gradient
reduce-scatters (a third of the 2B step's collective bytes on v4-8) block the TensorCore. It
does run collective-permutes asynchronously, with matmuls scheduled between start and done.
A reduce-scatter over k devices is k-1 such permutes around a ring: the device at ring position
p starts from its chunk p-1, and at each step passes what it holds to p+1 and adds its own copy
of the chunk it received, so after k-1 steps it holds chunk p summed over the ring. Each device
sends (k-1)/k of the buffer, the ideal ring bytes. On a torus slice one ring per axis, slowest
axis first (torus.py's stages), leaves device (z, y, x) with chunk z*Y*X + y*X + x: the flat
reduce-scatter's result.

torch_xla 2.9's `collective_permute` carries no channel id, so inside our one SPMD program its
pairs would name replicas (libtpu aborts on such a module). The GSPMD partitioner, though,
turns a rotation of a tensor sharded along a mesh axis (a concatenation of its last slice and
the rest) into one collective-permute with a channel id over that axis. So each step leaves the
manual region for the rotation and comes back: the custom calls at the border move no data.
Chunk choices depend on the device's coordinate, which enters as data ([Note: rank as data]).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

from .manual_region import to_global, to_local

AXES = ("ring_z", "ring_y", "ring_x")


class TorusRings:
    """Reduce-scatters over every device of a slice of `shape` (x first; device id
    x + X*(y + Y*z)), one ring per axis longer than 1."""

    def __init__(self, shape: Sequence[int]):
        import torch_xla.distributed.spmd as xs

        shape = tuple(shape) + (1,) * (3 - len(shape))
        if len(shape) != 3:
            raise ValueError(f"a torus of at most three axes, not {shape}")
        self.shape = shape  # (X, Y, Z)
        self.devices = math.prod(shape)
        grid = tuple(reversed(shape))  # (Z, Y, X): row-major over device ids
        self.mesh = xs.Mesh(np.arange(self.devices), grid, AXES)
        self.spec = AXES + (None,)

    def axes(self) -> List[Tuple[int, int, int]]:
        """(mesh dim, devices along it, device-id stride) per ring, slowest axis first."""
        out = []
        for axis in (2, 1, 0):
            size = self.shape[axis]
            if size > 1:
                out.append((2 - axis, size, math.prod(self.shape[:axis])))
        return out

    def _rotate(self, held: torch.Tensor, dim: int) -> torch.Tensor:
        """Each device's `held` [m] -> the one held by its predecessor along mesh dim `dim`."""
        size = held.numel()
        glob = to_global(held.view(1, 1, 1, size), self.mesh, self.spec,
                         torch.Size(tuple(reversed(self.shape)) + (size,)))
        k = glob.shape[dim]
        turned = torch.cat([glob.narrow(dim, k - 1, 1), glob.narrow(dim, 0, k - 1)], dim)
        return to_local(turned, self.mesh, self.spec).reshape(size)

    def reduce_scatter(self, flat: torch.Tensor, device_id: torch.Tensor) -> torch.Tensor:
        """`flat` (1-D, a multiple of the device count) -> this device's chunk, summed over
        every device. `device_id`: a [1] long tensor holding this device's id (data)."""
        out = flat
        for dim, k, stride in self.axes():
            chunks = out.view(k, -1)
            at = torch.div(device_id, stride, rounding_mode="floor") % k  # ring position, [1]
            held = chunks.index_select(0, (at - 1) % k).reshape(-1)
            for step in range(k - 1):
                held = self._rotate(held, dim) + chunks.index_select(0, (at - step - 2) % k).reshape(-1)
            out = held
        return out
