"""The single-controller runtime's boundary: global tensors outside, per-device tensors inside.

[Note: single-controller runtime] Under torch_xla's SPMD runtime one process drives every device of the host. The
collective engine runs there unchanged, per device, inside an SPMD *manual-sharding region* (torch_xla's counterpart of
JAX's `shard_map`): at the root unit's forward every input is turned into its per-device piece (`SPMDFullToShardShape`),
every unit gathers its parameters and reduce-scatters their gradients with the same explicit pinned collectives as one
process per chip, and the root's outputs are turned back into global tensors (`SPMDShardToFullShape`). The partitioner
treats the region as partitioned already and inserts no collective of its own there, so the program holds exactly the
engine's schedule.

What the user sees is global. A parameter is one tensor of shape `[N * rows_per_rank, *rest]` (padded on dim 0) sharded
on dim 0 over the mesh's "fsdp" axis; any optimizer steps on it without communication. The model takes the global batch
and returns global outputs (`ManualRegion` states the rules).

Gradient scale: the output rules make the root's result a mean over devices (scalars) or a batch concatenation (whose
loss the user averages over the global batch), so each device's gradient already carries its 1/D share and the engine's
reduce-scatter sums instead of averaging.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from ..options import FSDP_AXIS
from .conversions import MeanOverDevices, ToGlobal, ToLocal, to_local
from .host_reads import refuse_host_reads

REPLICATE_AXIS = "replicate"

# is_batched_input(path, tensor) -> bool; `path` names the argument, e.g. "input_ids" or "args[0]"
BatchedInputFn = Callable[[str, torch.Tensor], bool]

_local = threading.local()


def in_manual_region() -> bool:
    """True while a root unit's forward runs per device."""
    return getattr(_local, "depth", 0) > 0


@dataclass(frozen=True)
class DevicePlacement:
    """The mesh of the single-controller runtime and the sharding groups laid on it. `shard_groups[i]` lists the device
    ids along the "fsdp" axis: they split each parameter among themselves. Devices at the same position of different
    groups hold the same shard (hybrid sharding). The batch is split over every device of the mesh."""

    mesh: Any  # torch_xla.distributed.spmd.Mesh
    shard_groups: Tuple[Tuple[int, ...], ...]

    @classmethod
    def build(cls, mesh, sharding_groups, num_devices: int) -> "DevicePlacement":
        import torch_xla.distributed.spmd as xs

        if mesh is not None:
            names = tuple(mesh.axis_names)
            if FSDP_AXIS not in names:
                raise ValueError(
                    f"mesh axes {names} have no {FSDP_AXIS!r} axis; the collective engine shards "
                    f"parameters over the axis named {FSDP_AXIS!r}. Name one axis {FSDP_AXIS!r} "
                    "(the others split the batch), or pass mesh=None for a 1-D mesh over all devices")
            from xla_fsdp.runtime.slices import axis_groups, check_within_slices

            check_within_slices(mesh, FSDP_AXIS, "XlaFullyShardedDataParallel(mesh=...)")
            groups = axis_groups(mesh, FSDP_AXIS)
            if sharding_groups is not None and sorted(map(tuple, sharding_groups)) != sorted(groups):
                raise ValueError(
                    f"sharding_groups={[list(g) for g in sharding_groups]} disagree with the mesh, whose "
                    f"{FSDP_AXIS!r} axis gives groups {[list(g) for g in groups]}; give one of the two")
            return cls(mesh, groups)
        groups = [list(range(num_devices))] if sharding_groups is None else [list(g) for g in sharding_groups]
        _check_partition(groups, num_devices)
        grid = np.asarray(groups, dtype=np.int64)
        mesh = xs.Mesh(grid.reshape(-1), grid.shape, (REPLICATE_AXIS, FSDP_AXIS))
        return cls(mesh, tuple(tuple(g) for g in groups))

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.mesh.mesh_shape))

    def spec(self, kind: str, ndim: int) -> tuple:
        """Partition spec of a `kind` ("param", "batch" or "replicated") tensor of `ndim` dims."""
        if kind == "param":
            return (FSDP_AXIS,) + (None,) * (ndim - 1) if ndim else ()
        if kind == "batch":
            axes = tuple(self.mesh.axis_names)
            return ((axes[0] if len(axes) == 1 else axes),) + (None,) * (ndim - 1)
        return (None,) * ndim

    def shard_positions(self) -> List[int]:
        """For each batch shard (row-major over the mesh), its device's position in its shard group."""
        where = {d: g.index(d) for g in self.shard_groups for d in g}
        return [where[int(d)] for d in np.asarray(self.mesh.device_ids).reshape(-1)]


def _check_partition(groups: List[List[int]], num_devices: int) -> None:
    flat = sorted(d for g in groups for d in g)
    if flat != list(range(num_devices)) or len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"sharding_groups={groups} must split the {num_devices} devices of this process "
            f"(ids 0..{num_devices - 1}) into groups of equal size, each device exactly once, "
            "e.g. [[0, 1, 2, 3], [4, 5, 6, 7]] for 8 devices")


# -- the region ---------------------------------------------------------------

def _is_kv_cache(x) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)


class ManualRegion:
    """Runs a root unit's forward per device; see [Note: single-controller runtime].

    Inputs: the batch size is dim 0 of the first tensor argument (with at least one dim). A tensor argument whose dim 0
    equals it is *batched* and split on dim 0 over every device; any other tensor (a mask broadcast over the batch, a
    position table, a 0-dim scalar) reaches every device whole. `is_batched_input(path, tensor)` overrides the rule.

    Outputs: a tensor whose dim 0 is the per-device batch is concatenated over devices back to the global batch; any
    other floating tensor (a loss, an auxiliary loss vector) is averaged over devices; Hugging Face KV caches
    (per-device tensors, used for generation only) become None. Other outputs are refused by name.

    Buffers reach every device whole; a forward that updates a buffer in place (BatchNorm running statistics) would give
    each device its own value, so it is refused, naming a runtime that keeps torch_xla's per-replica statistics here
    ([Note: buffers updated in place])."""

    def __init__(self, placement: DevicePlacement, comm, is_batched_input: Optional[BatchedInputFn] = None):
        self.placement = placement
        self.comm = comm
        self.is_batched_input = is_batched_input

    def run(self, root: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if in_manual_region():
            return forward(args, kwargs)
        args, kwargs, local_batch = self._inputs(args, kwargs)
        swapped = self._localize_buffers(root)
        outside = self._localize_params_outside_units(root)
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            with refuse_host_reads(in_manual_region):  # [Note: host reads in the manual region]
                out = forward(args, kwargs)
        finally:
            _local.depth -= 1
            for m, name, p in outside:
                m._parameters[name] = p
            self._restore_buffers(swapped)
        return self._outputs(out, local_batch)

    # -- inputs ---------------------------------------------------------------
    def _inputs(self, args, kwargs):
        mesh, devices = self.placement.mesh, self.placement.num_devices
        leaves, spec = tree_flatten_with_path((args, kwargs))
        batch = next((x.shape[0] for _, x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        out = []
        for path, x in leaves:
            if not isinstance(x, torch.Tensor):
                out.append(x)
                continue
            name = _arg_name(path)
            batched = (bool(self.is_batched_input(name, x)) if self.is_batched_input is not None
                       else x.dim() > 0 and x.shape[0] == batch)
            if batched and (x.dim() == 0 or x.shape[0] % devices):
                raise ValueError(
                    f"input {name} has batch size {x.shape[0] if x.dim() else 'none (0-dim)'}, which does "
                    f"not divide over the {devices} devices of the mesh; use a global batch that is a "
                    f"multiple of {devices} (each device takes an equal slice)")
            x = x.to(self.comm.device)
            part = self.placement.spec("batch" if batched else "replicated", x.dim())
            out.append(ToLocal.apply(x, mesh, part, None if batched else self._sum_over_devices) if x.requires_grad
                       else to_local(x, mesh, part))
        args, kwargs = tree_unflatten(out, spec)
        local_batch = None if batch is None else batch // devices
        return args, kwargs, local_batch

    def _sum_over_devices(self, grad: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.comm.all_reduce(grad, "shard"), "replicate")

    # -- buffers --------------------------------------------------------------
    def _localize_buffers(self, root: nn.Module) -> List[Tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]]:
        swapped = [(m, name, b, to_local(b, self.placement.mesh, self.placement.spec("replicated", b.dim())))
                   for m in root.modules() for name, b in m._buffers.items() if b is not None]
        for m, name, _, local in swapped:
            m._buffers[name] = local
        return [(m, name, b, local, local._version) for m, name, b, local in swapped]

    def _localize_params_outside_units(self, root: nn.Module) -> List[Tuple[nn.Module, str, torch.Tensor]]:
        """FSDP2's `ignored_params` (in no unit): each device computes with the whole replicated tensor, and its gradient
        is the sum over devices, as for a replicated input."""
        from ..unit_state import state_of, units

        managed = {(id(site.module), site.name) for u in units(root) for rec in state_of(u).group.params
                   for site in rec.sites}
        swapped = []
        for m in root.modules():
            for name, p in m._parameters.items():
                if p is None or (id(m), name) in managed:
                    continue
                spec = self.placement.spec("replicated", p.dim())
                m._parameters[name] = (ToLocal.apply(p, self.placement.mesh, spec, self._sum_over_devices)
                                       if p.requires_grad and torch.is_grad_enabled() else
                                       to_local(p, self.placement.mesh, spec))
                swapped.append((m, name, p))
        return swapped

    @staticmethod
    def _restore_buffers(swapped) -> None:
        changed = [f"{type(m).__name__}.{name}" for m, name, _, local, version in swapped
                   if m._buffers.get(name) is not local or local._version != version]
        for m, name, b, _, _ in swapped:
            m._buffers[name] = b
        if changed:
            raise RuntimeError(
                f"the forward updated buffer(s) {', '.join(changed)} in place; under the single-controller "
                "runtime each device would update its own copy from its own slice of the batch, and one "
                "buffer cannot hold a value per device. What works: "
                f"{_per_replica_buffers_path()}; or keep the statistics out of the training forward: "
                "BatchNorm(..., track_running_stats=False) normalizes with each device's batch statistics "
                "in training and evaluation alike, and .eval() on the BatchNorm modules freezes their "
                "running statistics")

    # -- outputs --------------------------------------------------------------
    def _outputs(self, out, local_batch: Optional[int]):
        leaves, spec = tree_flatten_with_path(out)
        mesh, devices = self.placement.mesh, self.placement.num_devices
        result = []
        for path, x in leaves:
            if _is_kv_cache(x):
                result.append(None)
            elif not isinstance(x, torch.Tensor):
                result.append(x)
            elif x.dim() > 0 and local_batch is not None and x.shape[0] == local_batch:
                shape = torch.Size([x.shape[0] * devices, *x.shape[1:]])
                result.append(ToGlobal.apply(x, mesh, self.placement.spec("batch", x.dim()), shape))
            elif x.is_floating_point():
                result.append(MeanOverDevices.apply(x, self.comm, mesh))
            else:
                raise ValueError(
                    f"output{keystr(path)} (shape {tuple(x.shape)}, {x.dtype}) is neither batched (dim 0 = the "
                    f"per-device batch {local_batch}) nor floating point, so it has no global value: "
                    "return it as a floating tensor to get its mean over devices, or batched")
        return tree_unflatten(result, spec)


# [Note: buffers updated in place] torch_xla's BatchNorm under one process per device is per replica: each replica
# updates its own running statistics from its own batch shard, and each holds a different value. In the
# single-controller runtime a buffer is one replicated global tensor; a per-device value would need another shape (and
# other state-dict keys) than the module's, and averaging the devices' updates would be a third semantics (neither
# torch_xla's nor SyncBatchNorm's: the running variance would miss the spread between the devices' means). So the region
# refuses, and says which runtime on this machine keeps torch_xla's semantics.
def _per_replica_buffers_path() -> str:
    """Where per-replica buffers run on this machine: one process per chip on a TPU; on CPU, where one process per
    device hangs, only one device."""
    import torch_xla.runtime as xr

    if xr.device_type() == "TPU":
        return ("one process per chip, torch_xla's per-replica statistics (launch/xla_spawn.py --per_chip, "
                "without --spmd or the runtime variable set to single_controller: docs/environment.md)")
    return (f"on {xr.device_type()} one process per device cannot run (its explicit collectives hang), so: "
            "one device, one process (launch/xla_spawn.py --num_cores 1), where the statistics update "
            "as in torch_xla; per-replica statistics over several devices need a TPU (xla_spawn --per_chip)")


def _arg_name(path) -> str:
    # path into ((args...), {kwargs}): args[i] or the keyword's name
    text = keystr(path)
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        rest = text[3:]
        return rest[2:-2] if rest.startswith("['") and rest.endswith("']") else "kwargs" + rest
    return text


# [Note: host reads in the manual region], for transformers: its mask code asks `is_tracing` before it
# reads tensor values; inside the region the answer is yes (integrations/transformers.py's enable()
# and scan_layers on a transformers model steer it)
_STEERED: Dict[int, Callable] = {}  # id(transformers' own is_tracing) -> ours


def steer_is_tracing() -> None:
    """Point every loaded transformers module's `is_tracing` at one that is true inside a manual region (again at wrap
    time: model modules load lazily)."""
    from transformers.utils import import_utils

    original = import_utils.is_tracing
    if id(original) not in _STEERED:
        def is_tracing(tensor=None) -> bool:
            # inside the region values cannot be read on the host: take the paths that do not read them
            return in_manual_region() or original(tensor)

        is_tracing.xla_fsdp_original = original
        _STEERED[id(original)] = is_tracing
    steered = _STEERED[id(original)]
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] == "transformers" and getattr(module, "is_tracing", None) is original:
            setattr(module, "is_tracing", steered)

