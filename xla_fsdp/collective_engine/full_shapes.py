"""`state_dict()` / `load_state_dict()` in the unwrapped model's shapes, single-controller runtime.

[Note: state dicts of the single controller] There each parameter is one
global tensor padded on dim 0 to a multiple of the sharding group size
([Note: dim-0 sharding]); the optimizer holds that tensor, so it stays
registered on the module. Left alone, `model.state_dict()` would return the
padded tensors (a Linear with 10 outputs at 4 devices: a (12, in) weight),
which load neither into the unwrapped model nor into a model sharded over
another device count. One process holds every parameter, so, as with the GSPMD
engine's global tensors, `state_dict()` returns the unwrapped model's shapes:
a hook on each module holding a padded parameter cuts the padding rows off
(a view of the real rows, as `state_dict()` returns views of parameters), and
`load_state_dict()` pads a full tensor again before the usual in-place copy
(which keeps the global tensor's sharding). A padded tensor (a state dict
saved before this) still loads as it is. While a unit is unsharded
(`summon_full_params`) the registered tensors are whole and nothing changes.

The hooks sit on the modules that own the parameters, not on the unit: keys
are then exactly those the module writes and reads, whatever wrappers around
it (torch's CheckpointWrapper) rename later. They hold the records weakly, so
no reference cycle keeps a dropped model's parameters alive.

With one process per device `state_dict()` stays each rank's shard (torch_xla's
per-rank flow, with `get_shard_metadata()`). The optimizer's state dict follows
([Note: optimizer state of the single controller] in optimizer_shapes.py).
"""
from __future__ import annotations

import weakref
from typing import Dict

import torch
import torch.nn as nn

from . import optimizer_shapes
from .param import FSDPParam


class _PaddedParams:
    """The padded global parameters of one module, by their name in it."""

    def __init__(self, records: Dict[str, FSDPParam]):
        self._records = {name: weakref.ref(rec) for name, rec in records.items()}

    def padded(self, module: nn.Module):
        """(name, record) for each parameter registered padded right now (not unsharded)."""
        for name, ref in self._records.items():
            rec = ref()
            if rec is not None and module._parameters.get(name) is rec.sharded:
                yield name, rec


class _CutPadding(_PaddedParams):
    """state_dict post-hook: padded rows off."""

    def __call__(self, module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
        for name, rec in self.padded(module):
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state_dict[key][: rec.rows].reshape(rec.orig_shape)


class _PadAgain(_PaddedParams):
    """load_state_dict pre-hook: a full tensor padded to the global tensor's shape."""

    def __call__(self, module: nn.Module, state_dict, prefix: str, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        for name, rec in self.padded(module):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(rec.orig_shape):
                state_dict[prefix + name] = rec.padded(value)


def register(group) -> None:
    """Hooks for every parameter of `group` (single-controller runtime) that has padding rows, and
    for the optimizers that will hold them ([Note: optimizer state of the single controller])."""
    by_module: Dict[int, tuple] = {}
    padded = []
    for rec in group.params:
        if (rec.padded_rows, *rec.row_shape) == tuple(rec.orig_shape):
            continue  # no padding: the global tensor has the parameter's shape
        padded.append(rec)
        for site in rec.sites:
            by_module.setdefault(id(site.module), (site.module, {}))[1][site.name] = rec
    for module, records in by_module.values():
        module.register_state_dict_post_hook(_CutPadding(records))
        module.register_load_state_dict_pre_hook(_PadAgain(records))
    if padded:
        optimizer_shapes.register(padded, group.comm)
