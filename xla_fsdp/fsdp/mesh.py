"""The mesh `fully_shard` shards over, and the `DeviceMesh` its parameters report.

[Note: FSDP2 meshes on the single controller] FSDP2 scripts build a mesh over
processes (`init_device_mesh("cuda", (world_size,))`: one rank per GPU). Here
one process drives every chip of its host, so a process is not a device: a
1-D `DeviceMesh("xla", ...)` whose size is the number of processes means
"shard over every device of those processes", and one whose size is the
number of devices means the devices themselves. Anything else does not cover
the job and is refused. Parameters report a 1-D `DeviceMesh("xla", devices,
mesh_dim_names=("fsdp",))` built without a process group, which is what
`distribute_tensor(full, p.device_mesh, p.placements)` needs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple


def _devices_and_processes() -> Tuple[int, int]:
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count(), xr.process_count()


@dataclasses.dataclass
class ShardMesh:
    """What `fully_shard` shards over: torch_xla's mesh (one "fsdp" axis over every device, the
    engine's), the `DeviceMesh` its parameters report, and the collectives every unit over it
    shares (the first unit's, set when it is built). One per device count, for the process."""

    xla: Any
    device_mesh: Any
    collectives: Optional[Any] = None


def resolve_fsdp_mesh(mesh) -> ShardMesh:
    """`mesh=` of fully_shard -> the `ShardMesh` over every device."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    devices, processes = _devices_and_processes()
    if mesh is not None:
        if isinstance(mesh, xs.Mesh):
            size = int(np.prod(mesh.mesh_shape))
            kind = f"torch_xla Mesh {dict(zip(mesh.axis_names or (), mesh.mesh_shape))}"
        elif hasattr(mesh, "device_type") and hasattr(mesh, "mesh"):
            if mesh.device_type != "xla":
                raise ValueError(f"fully_shard(mesh=...) got a DeviceMesh of device type {mesh.device_type!r}; on "
                                 f"a TPU build it with init_device_mesh(\"xla\", (world_size,))")
            if mesh.ndim != 1:
                raise ValueError(f"fully_shard(mesh=...) got a {mesh.ndim}-D DeviceMesh: HSDP meshes are not "
                                 "supported here; pass a 1-D mesh (or none) to shard over every device")
            size = mesh.size()
            kind = f"DeviceMesh of {size}"
        else:
            raise TypeError(f"fully_shard(mesh=...) expects a torch DeviceMesh (device type \"xla\") or a "
                            f"torch_xla Mesh, got {type(mesh).__name__}")
        if size not in (devices, processes):
            raise ValueError(f"fully_shard(mesh=...): the {kind} covers {size} devices or processes, but this "
                             f"job has {processes} process(es) driving {devices} devices; use a 1-D mesh of "
                             f"{processes} (one entry per process, init_device_mesh(\"xla\", (world_size,))) "
                             f"or of {devices} (one per device), or pass no mesh")
    if devices not in _shard_meshes:  # one per device count: units built over it share collectives
        _shard_meshes[devices] = ShardMesh(xs.Mesh(np.arange(devices), (devices,), ("fsdp",)), device_mesh(devices))
    return _shard_meshes[devices]


_shard_meshes: Dict[int, ShardMesh] = {}


_meshes: dict = {}


def device_mesh(devices: int):
    """A 1-D DeviceMesh("xla") over `devices` devices named "fsdp", made without a process group."""
    if devices not in _meshes:
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        _meshes[devices] = DeviceMesh("xla", torch.arange(devices), mesh_dim_names=("fsdp",), _init_backend=False)
    return _meshes[devices]


def process_count() -> int:
    """FSDP2's world size: processes (torch.distributed's count when a group is up)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _devices_and_processes()[1]
