"""The mesh `fully_shard` shards over, and the `DeviceMesh` its parameters report.

[Note: FSDP2 meshes on the single controller] FSDP2 scripts build a mesh over processes
(`init_device_mesh("cuda", (world_size,))`: one rank per GPU). Here one process drives every chip of its host, so a
process is not a device: a 1-D `DeviceMesh("xla", ...)` of the number of processes means "shard over every device of
those processes", and one of the number of devices means the devices themselves. A 2-D mesh is HSDP (torchtitan's
`dp_replicate` x `dp_shard`): dim 0 replicates, dim 1 shards, and its size is again the devices or the processes (then
each process entry stands for that host's devices, laid along the shard dim). Anything else does not cover the job, or
is 3-D, and is refused. Parameters report a `DeviceMesh("xla", ...)` over the devices built without a process group, 1-D
(`"fsdp"`) or 2-D (the names the script gave), which is what `distribute_tensor(full, p.device_mesh, p.placements)`
needs.

[Note: FSDP2 meshes across slices] On a job that spans slices ([Note: HSDP across slices] in runtime/slices.py) no
parameter is sharded across slices: a 1-D mesh (or none) means HSDP with one replica per slice (parameters then report a
2-D mesh, `Replicate()` then `Shard(0)`), and a 2-D mesh's replicate dim must be a multiple of the slices."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

HSDP_NAMES = ("dp_replicate", "dp_shard")


def _devices_and_processes() -> Tuple[int, int]:
    """Devices and hosts (one process each; virtual hosts count as hosts)."""
    import torch_xla.runtime as xr

    from ..runtime.hosts import host_view

    return xr.global_runtime_device_count(), host_view().count


@dataclasses.dataclass
class ShardMesh:
    """What `fully_shard` shards over: torch_xla's mesh (the engine's: an "fsdp" axis, after a "replicate" axis under
    HSDP), the `DeviceMesh` its parameters report, and the collectives every unit over it shares (the first unit's, set
    when it is built). One per shape, for the process."""

    xla: Any
    device_mesh: Any
    collectives: Optional[Any] = None

    @property
    def replicas(self) -> int:
        return int(self.xla.mesh_shape[0]) if len(self.xla.mesh_shape) == 2 else 1

    def shard_groups(self) -> list:
        """The device ids of each shard group: the rows of the mesh."""
        import numpy as np

        rows = np.asarray(self.xla.device_ids).reshape(self.replicas, -1)
        return [[int(d) for d in row] for row in rows]


def resolve_fsdp_mesh(mesh) -> ShardMesh:
    """`mesh=` of fully_shard -> the `ShardMesh` over every device (see the note above)."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    devices, processes = _devices_and_processes()
    replicas, names = 1, None
    if mesh is not None:
        if isinstance(mesh, xs.Mesh):
            size, shape = int(np.prod(mesh.mesh_shape)), tuple(mesh.mesh_shape)
            kind = f"torch_xla Mesh {dict(zip(mesh.axis_names or (), mesh.mesh_shape))}"
            if len(shape) == 2 and tuple(mesh.axis_names or ()) != ("replicate", "fsdp"):
                raise ValueError(f"fully_shard(mesh=...) got a 2-D {kind}: name its axes (\"replicate\", \"fsdp\") "
                                 "for HSDP, or pass a DeviceMesh")
        elif hasattr(mesh, "device_type") and hasattr(mesh, "mesh"):
            if mesh.device_type != "xla":
                raise ValueError(f"fully_shard(mesh=...) got a DeviceMesh of device type {mesh.device_type!r}; on "
                                 f"a TPU build it with init_device_mesh(\"xla\", (world_size,))")
            size, shape = mesh.size(), tuple(mesh.mesh.shape)
            kind = f"{mesh.ndim}-D DeviceMesh {shape}"
            names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        else:
            raise TypeError(f"fully_shard(mesh=...) expects a torch DeviceMesh (device type \"xla\") or a "
                            f"torch_xla Mesh, got {type(mesh).__name__}")
        if len(shape) > 2:
            raise ValueError(f"fully_shard(mesh=...) got a {kind}: meshes here are 1-D (shard over every device) or "
                             "2-D for HSDP (dp_replicate, dp_shard); tensor or context parallel dims are not "
                             "supported by xla_fsdp.fsdp")
        if len(shape) == 2 and size not in (devices, processes):
            hint = (f"a replicate dim of {shape[0]} does not divide the {devices} devices" if devices % shape[0]
                    else f"with a replicate dim of {shape[0]} the shard dim is {devices // shape[0]}")
            raise ValueError(f"fully_shard(mesh=...): the HSDP {kind} (replicate {shape[0]} x shard {shape[1]}) covers "
                             f"{size} devices, but this job has {devices} devices in {processes} process(es): "
                             f"{hint} (init_device_mesh(\"xla\", (replicate, devices // replicate)))")
        if size not in (devices, processes):
            raise ValueError(f"fully_shard(mesh=...): the {kind} covers {size} devices or processes, but this "
                             f"job has {processes} process(es) driving {devices} devices; use a 1-D mesh of "
                             f"{processes} (one entry per process, init_device_mesh(\"xla\", (world_size,))) "
                             f"or of {devices} (one per device), a 2-D (replicate, shard) mesh of as many, or "
                             "pass no mesh")
        replicas = shape[0] if len(shape) == 2 else 1
        if devices % replicas:
            raise ValueError(f"fully_shard(mesh=...): the {kind}'s replicate dim of {replicas} does not divide the "
                             f"{devices} devices")
    from ..runtime.slices import device_slices

    slices = device_slices()  # [Note: FSDP2 meshes across slices]
    if len(slices) > 1 and replicas == 1:
        replicas = len(slices)
    elif replicas % len(slices):
        raise ValueError(f"fully_shard(mesh=...): a replicate dim of {replicas} on a job of {len(slices)} slices "
                         "would shard a parameter across slices, over the data-center network; give a replicate "
                         f"dim that is a multiple of {len(slices)}, or a 1-D mesh (one replica per slice)")
    ids = np.asarray(slices).reshape(-1)  # slice by slice: each shard group within one slice
    key = (replicas, names)
    if key not in _shard_meshes:  # one per shape: units built over it share collectives
        if replicas == 1:
            _shard_meshes[key] = ShardMesh(xs.Mesh(ids, (devices,), ("fsdp",)), device_mesh(devices))
        else:
            shape = (replicas, devices // replicas)
            _shard_meshes[key] = ShardMesh(xs.Mesh(ids, shape, ("replicate", "fsdp")),
                                           device_mesh(devices, shape, names or HSDP_NAMES))
    return _shard_meshes[key]


_shard_meshes: Dict[tuple, ShardMesh] = {}


_meshes: dict = {}


def device_mesh(devices: int, shape: Optional[Tuple[int, ...]] = None, names: Tuple[str, ...] = ("fsdp",)):
    """A DeviceMesh("xla") over `devices` devices (1-D "fsdp", or `shape` with `names`), made without a process
    group."""
    shape = shape or (devices,)
    key = (shape, names)
    if key not in _meshes:
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        _meshes[key] = DeviceMesh("xla", torch.arange(devices).reshape(shape), mesh_dim_names=names,
                                  _init_backend=False)
    return _meshes[key]


def process_count() -> int:
    """FSDP2's world size: processes (torch.distributed's count when a group is up)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _devices_and_processes()[1]
