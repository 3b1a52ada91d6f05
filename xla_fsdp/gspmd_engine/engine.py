"""The SPMD engine (`engine="spmd"`, Hugging Face's `xla_fsdp_v2`).

FSDP expressed as shardings: every parameter is sharded on dim 0 over the mesh axis "fsdp" and the XLA SPMD partitioner
inserts the all-gathers and reduce-scatters (see [Note: SPMD sharding layout] in xla_fsdp/runtime/mesh.py). The module
is changed in place, so parameter names and state-dict keys are the unwrapped model's. The steps, in order:

1. find the units (auto-wrap policy), innermost first; apply `auto_wrapper_callable` to each non-root unit;
2. per unit: materialize meta tensors (`param_init_fn`), move its tensors to the XLA device and shard its parameters;
3. install the compute views: each module computes with a compute-dtype and/or gathered (replicated-annotated) copy of
   its parameters ([Note: gathering parameters by annotation] in params.py);
4. give layer norms a batch-partitionable forward ([Note: why the SPMD engine rewrites LayerNorm] in norms.py);
5. checkpoint every non-root unit if asked;
6. annotate activations on the batch dim ([Note: why annotate activations] in activations.py): the inputs and outputs
   of every unit and the inputs of every module that owns parameters.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

from xla_fsdp.runtime.choice import check_spmd_came_first
from xla_fsdp.runtime.mesh import resolve_mesh
from xla_fsdp.gspmd_engine.activations import BatchSharding, checkpoint_unit
from xla_fsdp.memory.remat_policy import policy_named
from xla_fsdp.gspmd_engine.norms import install_partitionable_layer_norms
from xla_fsdp.gspmd_engine.padded_rows import pad_uneven_rows
from xla_fsdp.gspmd_engine.params import install_compute_views, owns_parameters
from xla_fsdp.layer_scan.find import find_layer_lists
from xla_fsdp.layer_scan.gspmd.scan import ScanSettings, install_scans
from xla_fsdp.layer_scan.stored_stacks import check_shared as check_stackable
from xla_fsdp.gspmd_engine.units import ParamInitFn, Placed, WrapPolicy, find_units, materialize_unit, place_and_shard

# Roots already handled: a second application would stack a second set of hooks (double casts and annotations).
_applied: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def apply_spmd_fsdp(module: nn.Module, *, mesh: Optional[xs.Mesh] = None, compute_dtype: Optional[torch.dtype] = None,
                    buffer_dtype: Optional[torch.dtype] = None, auto_wrap_policy: Optional[WrapPolicy] = None,
                    auto_wrapper_callable: Optional[Callable[[nn.Module], nn.Module]] = None,
                    param_init_fn: Optional[ParamInitFn] = None, activation_checkpointing: bool = False,
                    gather_params: bool = False, batch_axes: Optional[Sequence[str]] = None,
                    scan_layers: Union[bool, str] = False, applied_units: Sequence[nn.Module] = (), remat_policy=None):
    """Shards `module` in place over the SPMD mesh and returns it.

    Args:
      module: the model; may hold meta tensors (see `param_init_fn`).
      mesh: a mesh with an axis named "fsdp"; default a 1-D mesh over every device of this process.
      compute_dtype: dtype parameters are cast to for forward/backward math; the Parameters (and gradients,
        optimizer state) stay in their dtype.
      buffer_dtype: dtype floating buffers are stored in.
      auto_wrap_policy: `policy(module=, recurse=, unwrapped_params=) -> bool` choosing the units (torch_xla /
        xla_fsdp.wrap protocol).
      auto_wrapper_callable: `fn(unit) -> module` applied to every non-root unit before sharding; if it returns a
        different module, that module is installed under the unit's name (and its parameter names are used).
      param_init_fn: `fn(unit)` called for each unit that still has meta tensors, before they are sharded; default:
        `to_empty` on the host and `reset_parameters()`.
      activation_checkpointing: recompute every non-root unit in backward.
      gather_params: make every module compute with a replicated view of its parameters, forcing FSDP's all-gather /
        reduce-scatter pattern instead of letting GSPMD choose ([Note: gathering parameters by annotation]).
      scan_layers: run each nn.ModuleList of identical units as one XLA While loop ([Note: scanning the layers of a
        ModuleList]), each layer recomputed inside it with activation_checkpointing. True stores each parameter of
        the layers once, stacked ([Note: parameters stored stacked]); "per_step" stacks per-layer parameters every
        step (for optimizers with per-tensor statistics other than Hugging Face's Adafactor).
      applied_units: submodules this engine sharded on their own, same mesh and batch axes (torch_xla's
        FSDPv2 nesting): left as they are; the root takes what they leave.
      remat_policy: what each checkpointed unit saves ([Note: recomputation policies]); default "full".
    """
    mesh = _checked_mesh(module, mesh, batch_axes)
    device = torch_xla.device()
    inner = [m for unit in applied_units for m in unit.modules()]
    _check_alone(inner, auto_wrap_policy, compute_dtype, gather_params, activation_checkpointing, scan_layers)

    units = find_units(module, auto_wrap_policy)
    if auto_wrapper_callable is not None:
        units = _apply_wrapper(module, units, auto_wrapper_callable)

    # checked before anything is placed: a refusal leaves the model as it was
    stored = scan_layers is True  # "per_step": stack every step
    found = find_layer_lists(module, units, check_stackable if stored else None) if scan_layers else []
    scanned = {id(layer) for _, _, layers, _ in found for layer in layers}
    if scanned and gather_params:
        raise ValueError("scan_layers with gather_params is not supported: inside the loop the partitioner places the "
                         "parameters.")

    done: Placed = {id(t): (t, t) for m in applied_units for t in list(m.parameters()) + list(m.buffers())}
    for unit in units:
        # its parameters and buffers not already placed by an inner unit
        materialize_unit(unit, [t for t in [*unit.parameters(), *unit.buffers()] if id(t) not in done], param_init_fn)
        place_and_shard(unit, done, mesh, device, buffer_dtype)

    # [Note: padded rows]; not inside scanned layers
    pad_uneven_rows(module, mesh, [layer for _, _, layers, _ in found for layer in layers] + list(applied_units))
    _, views = install_compute_views(module, compute_dtype, mesh, gather_params)

    # Before checkpointing: a LayerNorm unit's checkpoint must wrap this forward.
    install_partitionable_layer_norms(module)
    if activation_checkpointing:
        for unit in units[:-1]:
            if id(unit) not in scanned:  # a scanned layer recomputes in the loop, as ScanSettings' policy says
                checkpoint_unit(unit, views.get(unit), remat_policy)

    batch = _annotate_batches(module, units, mesh, batch_axes, inner)
    if found:
        settings = ScanSettings(mesh, compute_dtype, batch.annotate, recompute=activation_checkpointing,
                                policy=policy_named(remat_policy) if activation_checkpointing else None,
                                stored=stored, batch_entry=batch.batch_entry)
        install_scans(module, found, settings)
    _applied.add(module)
    return module


def _check_alone(inner, *options) -> None:
    if inner and any(o is not None and o is not False for o in options):
        raise ValueError("units sharded on their own take no root auto_wrap_policy, compute_dtype, gather_params, "
                         "activation_checkpointing or scan_layers; shard the model once, from its root")


def _checked_mesh(module: nn.Module, mesh: Optional[xs.Mesh], batch_axes: Optional[Sequence[str]]) -> xs.Mesh:
    """The mesh to shard over, once SPMD mode, a first application and the batch axes are checked."""
    check_spmd_came_first("the SPMD engine")
    if module in _applied:
        raise ValueError(f"{type(module).__name__} is already sharded by the SPMD engine; apply it once, to the root "
                         "model.")
    if mesh is not None:
        from xla_fsdp.runtime.slices import check_within_slices

        check_within_slices(mesh, "fsdp", "the SPMD engine's mesh")
    mesh = resolve_mesh(mesh)
    unknown = [a for a in batch_axes or () if a not in mesh.axis_names]
    if unknown or batch_axes is not None and not batch_axes:
        raise ValueError(f"batch_axes {batch_axes!r} must name axes of the mesh "
                         f"{tuple(mesh.axis_names)} (at least one); default: all of them.")
    return mesh


def _annotate_batches(module: nn.Module, units, mesh: xs.Mesh, batch_axes, inner=()) -> BatchSharding:
    """The batch's sharding on the root's inputs and outputs and on every unit's and parameter
    owner's inputs (`inner`: modules of units sharded on their own, annotated then)."""
    batch = BatchSharding(mesh, batch_axes)
    # prepend: see the batch before the compute-dtype cast of the inputs.
    module.register_forward_pre_hook(batch.root_inputs, with_kwargs=True, prepend=True)
    module.register_forward_hook(lambda m, args, out: batch.annotate(out))
    for unit in units[:-1]:
        unit.register_forward_pre_hook(batch.unit_inputs, with_kwargs=True)
        unit.register_forward_hook(batch.unit_output)
    skip = {id(m) for m in [*units, *inner]}
    for owner in module.modules():  # every other module that owns a parameter
        if id(owner) not in skip and owns_parameters(owner):
            owner.register_forward_pre_hook(batch.unit_inputs, with_kwargs=True)
    return batch


def _apply_wrapper(root: nn.Module, units: List[nn.Module],
                   wrapper: Callable[[nn.Module], nn.Module]) -> List[nn.Module]:
    """Runs `wrapper` on each non-root unit and installs what it returns."""
    parents = {child: (parent, name) for parent in root.modules() for name, child in parent.named_children()}
    wrapped: List[nn.Module] = []
    for unit in units[:-1]:
        result = wrapper(unit)
        if not isinstance(result, nn.Module):
            raise TypeError(f"auto_wrapper_callable returned {type(result).__name__} for unit "
                            f"{type(unit).__name__}; it must return an nn.Module.")
        if result is not unit:
            parent, name = parents[unit]
            setattr(parent, name, result)
        wrapped.append(result)
    wrapped.append(root)
    return wrapped
