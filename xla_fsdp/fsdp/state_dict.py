"""State dicts of `fully_shard` modules: what FSDP2 scripts save and load.

`model.state_dict()` has the unwrapped model's keys and shapes (the collective
engine's single-controller hooks cut the padding rows, [Note: state dicts of
the single controller]); its values are whole global XLA tensors, never
`ShardedParameter`s. FSDP2 scripts call `v.full_tensor()` on them (DTensors
there), so each value is a `StateTensor`: a plain tensor whose `full_tensor()`
and `to_local()` return it as a plain tensor; it pickles and deep-copies as a
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

from typing import Dict

import torch
import torch.nn as nn

from .param import ShardedParameter


class StateTensor(torch.Tensor):
    """A state-dict value: a plain tensor with DTensor's `full_tensor()`, `to_local()` and
    `placements`, as FSDP2 scripts call them on `model.state_dict()` values."""

    @staticmethod
    def wrap(t: torch.Tensor) -> "StateTensor":
        return torch.Tensor._make_subclass(StateTensor, t, False)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def full_tensor(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    @property
    def placements(self):
        from torch.distributed.tensor import Replicate

        return (Replicate(),)

    def __reduce_ex__(self, proto):
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()


def _plain_values(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and not isinstance(value, StateTensor):
            if isinstance(value, ShardedParameter) or value.device.type == "xla":
                state_dict[key] = StateTensor.wrap(value.detach())


def register(module: nn.Module) -> None:
    """The state-dict hook of one fully_shard unit (values as `StateTensor`s)."""
    module.register_state_dict_post_hook(_plain_values)


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
    from .module import FSDPModule

    values: Dict[str, object] = {k: _global_value(v) if isinstance(v, torch.Tensor) else v
                                 for k, v in state_dict.items()}
    shapes = _expected_shapes(root)
    wrong = [f"{k}: checkpoint {tuple(v.shape)}, model {shapes[k]}" for k, v in values.items()
             if k in shapes and isinstance(v, torch.Tensor) and tuple(v.shape) != shapes[k]
             and tuple(v.shape) != _padded_shape(root, k)]
    if wrong:
        raise ValueError("load_state_dict: shapes do not match the model (nothing was loaded): " + "; ".join(wrong[:5])
                         + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    result = nn.Module.load_state_dict(root, values, strict=strict, assign=assign)
    for unit in [m for m in root.modules() if isinstance(m, FSDPModule)]:
        _adopt(unit)
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


def _adopt(unit) -> None:
    """After a load: each record's sharded parameter holds the value registered in its place
    (assign=True put a new tensor there), sharded on dim 0 on the unit's devices."""
    import torch_xla

    group = unit._fsdp_state.group
    comm = group.comm
    for rec in group.params:
        site = rec.sites[0]
        current = site.module._parameters.get(site.name)
        if current is rec.sharded and not rec.sharded.is_meta:
            if rec.sharded.device.type == "xla" and not torch_xla._XLAC._get_xla_sharding_spec(rec.sharded):
                with torch.no_grad():
                    rec.sharded.data = comm.place_global(rec.sharded.data)
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
        if was_meta and (rec.padded_rows, *rec.row_shape) != tuple(rec.orig_shape):
            from ..collective_engine import optimizer_shapes

            optimizer_shapes.register([rec], comm)
