"""State dicts of `fully_shard` modules: what FSDP2 scripts save and load.

`model.state_dict()` has the unwrapped model's keys and shapes (the collective
engine's single-controller hooks cut the padding rows, [Note: state dicts of
the single controller]); its values are whole global XLA tensors, never
`ShardedParameter`s. FSDP2 scripts call `v.full_tensor()` on them (DTensors
there) and read `v.device_mesh` / `v.placements` to `distribute_tensor` a full
state dict onto a meta model, so each value is a `StateTensor`: a plain tensor
whose `full_tensor()` and `to_local()` return it as a plain tensor, and which
reports the mesh and `(Shard(0),)` of the parameter it comes from; it pickles and deep-copies as a
plain tensor, so `torch.save`, `copy.deepcopy` and DCP see ordinary tensors.

[Note: loading into sharded parameters] Loading keeps every parameter a dim-0
sharded global tensor, whatever the values are:
- a CPU tensor (torch.load, a full state dict): copied in place, which keeps
  the sharding;
- an XLA tensor without sharding: copied, then the parameter is marked
  sharded again (an in-place copy from an unsharded XLA tensor drops it);
- `distribute_tensor(full, p.device_mesh, p.placements)`: torch_xla makes
  that an `XLAShardedTensor`; its global tensor is taken;
- `assign=True` (FSDP2's meta-device load): nn.Module puts the given tensor
  in the parameter's place; afterwards each unit takes it into its own
  sharded parameter (materializing a meta one), so the engine, the optimizer
  and `ShardedParameter`'s attributes keep working.
"""
from __future__ import annotations

import weakref
from typing import Dict

import torch
import torch.nn as nn

from .param import ShardedParameter


class StateTensor(torch.Tensor):
    """A state-dict value: a plain tensor with DTensor's `full_tensor()`, `to_local()`,
    `device_mesh` and `placements`, as FSDP2 scripts use them on `model.state_dict()` values."""

    @staticmethod
    def wrap(t: torch.Tensor, device_mesh) -> "StateTensor":
        out = torch.Tensor._make_subclass(StateTensor, t, False)
        out.device_mesh = device_mesh
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def full_tensor(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    @property
    def placements(self):
        from torch.distributed.tensor import Shard

        return (Shard(0),)

    def __reduce_ex__(self, proto):
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()

    def __repr__(self) -> str:
        return f"StateTensor(shape={tuple(self.shape)}, placements=(Shard(dim=0),), device={self.device})"


class _StateTensors:
    """state_dict post-hook of one unit: the values of its parameters as `StateTensor`s."""

    def __init__(self, unit: nn.Module):
        self._unit = weakref.ref(unit)

    def __call__(self, module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
        unit = self._unit()
        if unit is None:
            return
        mesh = unit._fsdp2_device_mesh
        names = {prefix + n for n, p in module.named_parameters(remove_duplicate=False)}
        for key, value in list(state_dict.items()):
            if key in names and isinstance(value, torch.Tensor) and not isinstance(value, StateTensor):
                state_dict[key] = StateTensor.wrap(value.detach(), mesh)


def register(module: nn.Module) -> None:
    """The state-dict hooks of one fully_shard unit (the step settled first, values as `StateTensor`s)."""
    from . import optim_state

    module.register_state_dict_pre_hook(_settle_step)
    module.register_state_dict_post_hook(_StateTensors(module))
    optim_state.install()


def _settle_step(module, prefix, keep_vars) -> None:
    """A state dict reads every parameter: the last step's graph is cut first ([Note: the step cut])."""
    from . import step_cut

    step_cut.settle()


def _global_value(value):
    """A loaded value as a plain tensor (see the note above)."""
    if isinstance(value, StateTensor) or isinstance(value, ShardedParameter):
        return value.detach().as_subclass(torch.Tensor)
    global_tensor = getattr(value, "global_tensor", None)  # torch_xla's XLAShardedTensor
    if isinstance(global_tensor, torch.Tensor):
        return global_tensor
    if type(value).__name__ == "DTensor" and hasattr(value, "full_tensor"):
        return value.full_tensor()
    return value


def load_into(root: nn.Module, state_dict, strict: bool, assign: bool):
    """`root.load_state_dict(...)` for a fully_shard module (see [Note: loading into sharded parameters])."""
    from .units import fsdp2_units

    values: Dict[str, object] = {k: _global_value(v) if isinstance(v, torch.Tensor) else v
                                 for k, v in state_dict.items()}
    shapes = _expected_shapes(root)
    wrong = [f"{k}: checkpoint {tuple(v.shape)}, model {shapes[k]}" for k, v in values.items()
             if k in shapes and isinstance(v, torch.Tensor) and tuple(v.shape) != shapes[k]
             and tuple(v.shape) != _padded_shape(root, k)]
    if wrong:
        raise ValueError("load_state_dict: shapes do not match the model (nothing was loaded): " + "; ".join(wrong[:5])
                         + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    units = fsdp2_units(root)
    specs = {id(rec): _sharding_spec(rec.sharded) for unit in units for rec in unit._fsdp_state.group.params}
    result = nn.Module.load_state_dict(root, values, strict=strict, assign=assign)
    for unit in units:
        _adopt(unit, specs)
    return result


def _expected_shapes(root: nn.Module) -> Dict[str, tuple]:
    shapes = {}
    for name, p in root.named_parameters():
        shapes[name] = tuple(p.full_shape) if isinstance(p, ShardedParameter) else tuple(p.shape)
    return shapes


def _padded_shape(root: nn.Module, key: str):
    try:
        p = root.get_parameter(key)
    except AttributeError:
        return None
    return tuple(p.shape)


def _sharding_spec(t: torch.Tensor) -> str:
    if t.is_meta or t.device.type != "xla":
        return ""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def _adopt(unit, specs) -> None:
    """After a load: each record's sharded parameter holds the value registered in its place
    (assign=True put a new tensor there), sharded on dim 0 on the unit's devices. An in-place
    copy from an XLA tensor without sharding (or a replicated one: `set_state_dict` of a full
    state dict moves each value to the device whole), or DCP's in-place load into the
    unpadded view `state_dict()` gave of a padded parameter, leaves the parameter unsharded or
    replicated; it is placed again, through the host, sharded on dim 0."""
    import torch_xla

    group = unit._fsdp_state.group
    comm = group.comm
    for rec in group.params:
        site = rec.sites[0]
        current = site.module._parameters.get(site.name)
        if current is rec.sharded and not rec.sharded.is_meta:
            now = _sharding_spec(rec.sharded)
            if rec.sharded.device.type == "xla" and (not now or now != specs.get(id(rec), now)):
                with torch.no_grad():
                    rec.sharded.data = comm.place_global(rec.sharded.data.cpu())
            continue
        if current is None or current is rec.sharded:
            continue
        value = current.detach()
        if tuple(value.shape) == tuple(rec.orig_shape):
            value = rec.padded(value)
        data = comm.place_global(value.to(rec.orig_dtype).cpu() if value.device.type != "xla" else value)
        if torch_xla._XLAC._get_xla_sharding_spec(data) == "":
            import torch_xla.distributed.spmd as xs

            xs.mark_sharding(data, comm.placement.mesh, comm.placement.spec("param", data.dim()))
        was_meta = rec.sharded.is_meta
        rec.sharded = rec.param_cls(data, requires_grad=rec.requires_grad).bind(rec, unit._fsdp2_device_mesh)
        rec.register(rec.sharded)
        if getattr(unit, "_fsdp2_offload", None) is not None:  # [Note: CPU offload on the single controller]
            from .offload import to_host

            to_host(rec, unit)
        if was_meta and (rec.padded_rows, *rec.row_shape) != tuple(rec.orig_shape):
            from ..collective_engine import optimizer_shapes

            optimizer_shapes.register([rec], comm)
