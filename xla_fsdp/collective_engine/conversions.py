"""Global tensors <-> per-device pieces, at the boundary of the single controller's manual region.

Outside the region a tensor is one global XLA tensor laid out by a partition spec on the mesh; inside it each device
computes with its own piece ([Note: single-controller runtime] in manual_region.py). `to_local` / `to_global` convert
without autograd; `ToLocal`, `ToGlobal` and `MeanOverDevices` are the differentiable forms the region and the
collectives use.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

def _fresh(t: torch.Tensor) -> torch.Tensor:
    # a new IR value: annotating device data in place would change the data's own sharding
    if t.dtype == torch.bool:
        return t | False  # `+ 0` would make it int64
    return t * 1 if t.is_floating_point() or t.is_complex() else t + 0


def to_local(t: torch.Tensor, mesh, spec: tuple) -> torch.Tensor:
    """Global tensor -> this device's piece (no autograd)."""
    import torch_xla

    x = t
    if torch_xla._XLAC._get_xla_sharding_spec(t) != _spec_text(mesh, spec):  # parameters are laid out so already
        x = _fresh(t)
        torch_xla._XLAC._xla_mark_sharding(x, mesh.get_op_sharding(spec))
    return torch_xla._XLAC._spmd_full_to_shard_shape(x)


_SPEC_TEXT: Dict[Tuple[int, tuple], str] = {}


def _spec_text(mesh, spec: tuple) -> str:
    """How torch_xla prints the sharding `spec` on `mesh` (read once from a small probe)."""
    key = (id(mesh), spec)
    if key not in _SPEC_TEXT:
        import torch_xla

        # each dim as long as the devices it is split over: a probe of the whole mesh's size in
        # every dim would be 128**5 floats for a 5-D spec on v4-256's 128 chips (137 GB)
        probe = torch.zeros([_split_over(mesh, axes) for axes in spec]).to(torch_xla.device())
        torch_xla._XLAC._xla_mark_sharding(probe, mesh.get_op_sharding(spec))
        _SPEC_TEXT[key] = torch_xla._XLAC._get_xla_sharding_spec(probe)
    return _SPEC_TEXT[key]


def _split_over(mesh, axes) -> int:
    """Devices one dim of a partition spec is split over: 1 for None, else the product of the named (or numbered) mesh
    axes' sizes."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape)) if mesh.axis_names else {}
    named = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
    return int(math.prod(sizes[axis] if isinstance(axis, str) else mesh.mesh_shape[axis] for axis in named))


def to_global(t: torch.Tensor, mesh, spec: tuple, shape: torch.Size) -> torch.Tensor:
    """Per-device pieces -> the global tensor of `shape` laid out as `spec` (no autograd)."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    x = _fresh(t)
    manual = torch_xla._XLAC.OpSharding([], [], [], xs.ShardingType.MANUAL)
    torch_xla._XLAC._mark_manual_sharding(x, manual)
    return torch_xla._XLAC._spmd_shard_to_full_shape(x, mesh.get_op_sharding(spec), shape, x.dtype)


class ToLocal(torch.autograd.Function):
    """`to_local` whose gradient goes back to the global layout. For a replicated input every device used the whole
    tensor, so its global gradient is the sum of the per-device gradients (`sum_replicas`)."""

    @staticmethod
    def forward(ctx, t, mesh, spec, sum_replicas):
        # the stored shape: a ShardedParameter shows its own, unpadded one ([Note: FSDP2 parameters on XLA])
        ctx.mesh, ctx.spec, ctx.shape, ctx.sum_replicas = mesh, spec, torch.Tensor.size(t), sum_replicas
        return to_local(t, mesh, spec)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_replicas is not None:
            grad = ctx.sum_replicas(grad)
        return to_global(grad, ctx.mesh, ctx.spec, ctx.shape), None, None, None


class MeanOverDevices(torch.autograd.Function):
    """Per-device values -> their mean, one global (replicated) tensor. The sum is an all-reduce the engine issues
    inside the region, so the partitioner has nothing to add; each device's gradient is 1/D of the incoming one."""

    @staticmethod
    def forward(ctx, t, comm, mesh):
        ctx.mesh, ctx.devices = mesh, comm.layout.world_size
        total = comm.all_reduce(t, "world") / ctx.devices
        return to_global(total, mesh, (None,) * t.dim(), t.shape)

    @staticmethod
    def backward(ctx, grad):
        return to_local(grad, ctx.mesh, (None,) * grad.dim()) / ctx.devices, None, None


class ToGlobal(torch.autograd.Function):
    """`to_global` whose gradient is handed back to each device's piece."""

    @staticmethod
    def forward(ctx, t, mesh, spec, shape):
        ctx.mesh, ctx.spec = mesh, spec
        return to_global(t, mesh, spec, shape)

    @staticmethod
    def backward(ctx, grad):
        return to_local(grad, ctx.mesh, ctx.spec), None, None, None
