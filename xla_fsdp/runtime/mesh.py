"""The device mesh and the partition specs laid on it (the SPMD engine uses them; they sit outside it so the collectives
engine can share them).

[Note: SPMD sharding layout] One process drives every device of the host. Parameters are sharded on dim 0 over the mesh
axis "fsdp"; activations are sharded on the batch dim over every mesh axis (for the default 1-D mesh that is "fsdp" as
well), which is the FSDP algorithm written as shardings: the partitioner inserts the gathers of parameters and the
reductions of gradients back to the dim-0 layout (and may pick other collectives for some ops unless gather_params
forces the FSDP pattern; see gspmd_engine/params.py).

A dim 0 that the device count does not divide is still sharded: XLA's tiled sharding pads the last shards internally (a
[10, 3] weight on 4 devices keeps [3, 3] tiles, the last holding one real row), so the user-visible shape and the state
dict stay those of the unwrapped model. Only 0-dim tensors stay replicated; they have no dim to split."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xla_fsdp.options import FSDP_AXIS  # re-exported: the SPMD engine reads it from here

PartitionSpec = Tuple[object, ...]


def build_fsdp_mesh() -> xs.Mesh:
    """A 1-D mesh named "fsdp" over every device this process addresses; on a job that spans slices,
    `("slice", "fsdp")`: parameters split within a slice, one replica per slice ([Note: HSDP across slices] in
    slices.py)."""
    from xla_fsdp.runtime.slices import SLICE_AXIS, device_slices

    groups = device_slices()
    if len(groups) > 1:
        return xs.Mesh(np.asarray(groups).reshape(-1), (len(groups), len(groups[0])), (SLICE_AXIS, FSDP_AXIS))
    num_devices = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(num_devices), (num_devices,), (FSDP_AXIS,))


def resolve_mesh(mesh: Optional[xs.Mesh]) -> xs.Mesh:
    """Returns `mesh`, or the default 1-D mesh, after checking it has "fsdp"."""
    if mesh is None:
        return build_fsdp_mesh()
    if FSDP_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no {FSDP_AXIS!r} axis; the SPMD engine shards "
                         f"parameters over {FSDP_AXIS!r}. Name one mesh axis {FSDP_AXIS!r} or pass mesh=None for a 1-D "
                         "mesh over all devices.")
    return mesh


def fsdp_degree(mesh: xs.Mesh) -> int:
    """How many shards a parameter is split into."""
    return int(mesh.mesh_shape[mesh.axis_names.index(FSDP_AXIS)])


def data_degree(mesh: xs.Mesh, axes: Optional[Sequence[str]] = None) -> int:
    """How many shards the batch is split into (over `axes`, default every mesh axis)."""
    return int(np.prod(mesh.mesh_shape if axes is None else [mesh.mesh_shape[mesh.axis_names.index(a)] for a in axes]))


def param_spec(tensor: torch.Tensor) -> PartitionSpec:
    """Dim 0 over "fsdp", the rest replicated; 0-dim tensors replicated."""
    return (FSDP_AXIS,) + (None,) * (tensor.dim() - 1) if tensor.dim() else ()


def batch_spec(tensor: torch.Tensor, mesh: xs.Mesh, axes: Optional[Sequence[str]] = None) -> PartitionSpec:
    """Batch (dim 0) over `axes`, default all mesh axes, so no device holds a replica (torch_xla's FSDPv2 splits it over
    "fsdp" and its extra data axis)."""
    axes = tuple(mesh.axis_names) if axes is None else tuple(axes)
    first = axes[0] if len(axes) == 1 else axes
    return (first,) + (None,) * (tensor.dim() - 1)


def annotate(tensor: torch.Tensor, mesh: xs.Mesh, spec: PartitionSpec) -> torch.Tensor:
    """Puts a sharding annotation on a fresh copy of `tensor` and returns it.

    Runs for every parameter and unit boundary on every step, so it skips `xs.mark_sharding`'s XLAShardedTensor wrapper
    (and, in `mark_sharding_with_gradients`, a mesh re-parse per call); the OpSharding itself is cached by the mesh.
    `* 1` makes a new IR value (exact, even for -0.0 and NaN): annotating a clone of device data would collide with the
    data's own sharding. A boolean tensor (a Hugging Face 4-D attention mask passed to every layer) takes `| False`,
    since `* 1` would make it int64."""
    return annotate_with(tensor, mesh.get_op_sharding(spec))


def annotate_with(tensor: torch.Tensor, op_sharding) -> torch.Tensor:
    """`annotate` with an OpSharding already at hand (another tensor's)."""
    fresh = tensor | False if tensor.dtype == torch.bool else tensor * 1
    torch_xla._XLAC._xla_mark_sharding(fresh, op_sharding)
    return fresh


class ShardedView(torch.autograd.Function):
    """Identity whose output is annotated `forward_spec` and whose gradient is annotated `backward_spec`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mesh: xs.Mesh, forward_spec: PartitionSpec,
                backward_spec: PartitionSpec) -> torch.Tensor:
        ctx.mesh = mesh
        ctx.backward_spec = backward_spec
        return annotate(tensor, mesh, forward_spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return annotate(grad, ctx.mesh, ctx.backward_spec), None, None, None
