"""The slices of a multislice job: which devices each one holds.

[Note: HSDP across slices] Cloud TPU Multislice joins slices over the data-center network (DCN), far slower than the
chips' own links (ICI) within a slice. So a job on several slices shards parameters, gradients and optimizer state over
the devices of its slice only and keeps one replica per slice: each parameter is gathered over ICI, and each gradient
shard is all-reduced across slices once per step (hybrid sharding, HSDP). Every door does this by default when the job
spans slices: run_clm and `XlaFullyShardedDataParallel` (the collective engine's sharding groups are the slices:
HYBRID_SHARD), the GSPMD engine (a mesh `("slice", "fsdp")`, parameters split over "fsdp" only), FSDP2's `fully_shard`
on a 1-D mesh (docs/pods.md).

Which device is in which slice: on a TPU the runtime tells (each device's `slice_index`); the slices hold equal numbers
of devices. On XLA:CPU `MEGASCALE_NUM_SLICES=S` splits the devices into S virtual slices of consecutive ids, which is
how the tests prove the layout without a TPU."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from . import environment

SLICE_AXIS = "slice"


def slice_groups(num_devices: int, attributes: Optional[Sequence[dict]] = None) -> Tuple[Tuple[int, ...], ...]:
    """The global device ids of each slice, slice by slice (one group on one slice).

    `attributes`: torch_xla's `xr.global_runtime_device_attributes()`, one dict per device id; a `slice_index` in them
    places each device, else `MEGASCALE_NUM_SLICES` splits the ids into consecutive blocks."""
    count = environment.num_slices()
    if attributes and "slice_index" in attributes[0]:
        by_slice = {}
        for device, attrs in enumerate(attributes[:num_devices]):
            by_slice.setdefault(int(attrs["slice_index"]), []).append(device)
        groups = tuple(tuple(by_slice[s]) for s in sorted(by_slice))
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"the slices hold different numbers of devices ({[len(g) for g in groups]}); "
                             "xla_fsdp shards within a slice and needs slices of one size")
        return groups
    if count == 1:
        return (tuple(range(num_devices)),)
    if num_devices % count:
        raise ValueError(f"{environment.NUM_SLICES}={count} does not divide the {num_devices} devices into "
                         "slices of one size; give a number of slices that does")
    size = num_devices // count
    return tuple(tuple(range(s * size, (s + 1) * size)) for s in range(count))


def device_slices() -> Tuple[Tuple[int, ...], ...]:
    """`slice_groups` for the devices this process's SPMD runtime addresses."""
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    try:
        attributes = xr.global_runtime_device_attributes()
    except Exception:  # noqa: BLE001 - a runtime without attributes (the check's abstract devices): the variable
        attributes = None
    return slice_groups(n, attributes)


def axis_groups(mesh, axis: str) -> Tuple[Tuple[int, ...], ...]:
    """The device ids along `axis` of a torch_xla mesh: one group per position of the other axes."""
    import numpy as np

    names = tuple(mesh.axis_names)
    ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    rows = np.moveaxis(ids, names.index(axis), -1).reshape(-1, ids.shape[names.index(axis)])
    return tuple(tuple(int(d) for d in row) for row in rows)


def check_within_slices(mesh, axis: str, who: str) -> None:
    """A ValueError when the job spans slices and `mesh` splits parameters (`axis`) across them: each gather would cross
    the data-center network ([Note: HSDP across slices])."""
    if environment.num_slices() == 1:
        return
    slices = device_slices()
    where = {d: i for i, group in enumerate(slices) for d in group}
    crossing = [g for g in axis_groups(mesh, axis) if len({where.get(d, -1) for d in g}) > 1]
    if crossing:
        raise ValueError(
            f"{who}: this job spans {len(slices)} slices and the mesh's {axis!r} axis splits parameters across "
            f"them (devices {list(crossing[0])}), so every gather would cross the data-center network. Give a "
            f"mesh whose {axis!r} axis stays within a slice and another axis over the slices: shape "
            f"({len(slices)}, {len(slices[0])}), axes ('data', {axis!r}) (on a TPU torch_xla's "
            f"HybridMesh(ici_mesh_shape=(1, {len(slices[0])}), dcn_mesh_shape=({len(slices)}, 1), ...)); "
            "SpmdFullyShardedDataParallel then takes extra_data_axis='data'")
