"""Which modules are SPMD units, and how a unit's parameters get onto the mesh.

A unit is the granularity of the engine's per-module treatment: meta materialization (`param_init_fn`), activation
annotations and activation checkpointing. The compiler, not the unit, decides where the all-gathers go. Units are found
with the same policy protocol as torch_xla's FSDP (`policy(module=, recurse=, unwrapped_params=)`), but nothing is
wrapped: the modules stay where they are, so parameter names do not change.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

from xla_fsdp import abstract
from xla_fsdp.runtime.mesh import param_spec

WrapPolicy = Callable[..., bool]
ParamInitFn = Callable[[nn.Module], None]
# id(tensor) -> (tensor, its placed replacement), for every tensor handled.
Placed = Dict[int, Tuple[torch.Tensor, torch.Tensor]]


def find_units(root: nn.Module, auto_wrap_policy: Optional[WrapPolicy]) -> List[nn.Module]:
    """Units in post-order (innermost first); `root` is always the last one. Mirrors torch_xla's recursive wrapping
    decisions: descend while `policy(recurse=True)` says so, then make a module a unit when `policy(recurse=False)`
    accepts the parameters its units have not taken."""
    units: List[nn.Module] = []
    if auto_wrap_policy is not None:
        for child in root.children():
            _collect_units(child, auto_wrap_policy, units)
    units.append(root)
    return units


def _collect_units(module: nn.Module, policy: WrapPolicy, units: List[nn.Module]) -> int:
    """Appends the units under `module`; returns the parameter count they took."""
    total = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=total):
        return 0
    taken = sum(_collect_units(child, policy, units) for child in module.children())
    if policy(module=module, recurse=False, unwrapped_params=total - taken):
        units.append(module)
        return total
    return taken


def materialize_unit(unit: nn.Module, tensors: List[torch.Tensor], param_init_fn: Optional[ParamInitFn]) -> None:
    """Turns the unit's meta tensors into real ones before they are sharded. Runs per unit so that a deferred model
    never has to exist in full on the host beyond one unit plus the shards already on the devices."""
    if not any(t.is_meta for t in tensors) or abstract.skip_materialization(tensors):
        return  # nothing to do, or traced for the ahead-of-time check ([Note: abstract tracing])
    from xla_fsdp.deferred.compat import is_deferred, materialize_module

    if param_init_fn is not None:
        param_init_fn(unit)
    elif is_deferred(unit):
        # built by xla_fsdp.deferred_init: replay the recorded constructor (units come innermost first, so this
        # takes only what inner units left)
        materialize_module(unit)
    else:
        # Same default as torch FSDP: allocate, then the module's own init.
        from xla_fsdp.deferred import reset_meta_modules

        reset_meta_modules(unit.named_modules(), f"unit {type(unit).__name__}")
    still_meta = [name for name, t in list(unit.named_parameters()) + list(unit.named_buffers()) if t.is_meta]
    if still_meta:
        raise ValueError(f"after param_init_fn, unit {type(unit).__name__} still has meta tensors {still_meta[:5]}; "
                         "param_init_fn must materialize every meta parameter and buffer of the module it is given.")


def place_and_shard(unit: nn.Module, done: Placed, mesh: xs.Mesh, device: torch.device,
                    buffer_dtype: Optional[torch.dtype]) -> None:
    """Moves the unit's tensors to the XLA device; shards parameters on dim 0. A CPU Parameter cannot take XLA data
    through `.data =`, so each one is replaced by a new Parameter under the same name. `done` maps the id of every
    tensor already handled (old and new) to its replacement: tied weights registered in two modules get the same new
    Parameter, and tensors of inner units are left alone. `done` also holds the replaced tensors themselves: an id is
    only unique while its object lives. Buffers stay replicated: they are small and usually read whole (masks, position
    ids)."""
    for module in unit.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    new = _placed(tensor, is_param, mesh, device, buffer_dtype)
                    done[id(tensor)] = (tensor, new)
                    done[id(new)] = (new, new)
                table[name] = done[id(tensor)][1]


def _placed(tensor: torch.Tensor, is_param: bool, mesh: xs.Mesh, device: torch.device,
            buffer_dtype: Optional[torch.dtype]) -> torch.Tensor:
    data = tensor.detach()
    if not is_param and buffer_dtype is not None and data.is_floating_point():
        data = data.to(buffer_dtype)
    if data.is_meta and is_param and data.dim() > 0:  # [Note: abstract tracing]
        data = abstract.to_device(data, device, mesh.get_op_sharding(param_spec(data)))
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    data = abstract.to_device(data, device)
    if not is_param:
        return data
    param = nn.Parameter(data, requires_grad=tensor.requires_grad)
    if param.dim() > 0 and not is_sharded(param):
        xs.mark_sharding(param, mesh, param_spec(param))
    return param


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether the XLA tensor already carries a sharding annotation."""
    return torch_xla._XLAC._get_xla_sharding_spec(tensor) != ""
