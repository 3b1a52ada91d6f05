"""The `state_dict()` key of every parameter and buffer, under wrappers that rename them.

[Note: state-dict keys] A module's name in the module tree (what
`named_modules()` / `named_parameters()` on the root say) is not always its
state-dict prefix: torch's `CheckpointWrapper` and `OffloadWrapper`
(`ActivationWrapper`) register the module they wrap as
`_checkpoint_wrapped_module` and a state_dict hook strips that part again, so
`model.state_dict()` has the unwrapped model's keys. The engine knows each
parameter by its tree name (a unit's prefix + the site's path); a full state
dict, a checkpoint or the shard metadata must use the key instead, or it
drops or misnames the parameters under such a wrapper. `names(model)` mirrors
what `state_dict()` does, and `check_against_state_dict` refuses, naming the
key, anything that does not match the model's own `state_dict()` keys, so a
wrapper that renames in another way fails loudly instead of losing tensors.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, Tuple

import torch
import torch.nn as nn

WRAPPED = "_checkpoint_wrapped_module"


def _activation_wrapper_class():
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except Exception:  # torch built without torch.distributed
        return None
    return ActivationWrapper


def _drops_child_name(module: nn.Module, child: str) -> bool:
    """Whether `module`'s state_dict hook removes `child.` from its children's keys."""
    cls = _activation_wrapper_class()
    return child == WRAPPED and cls is not None and isinstance(module, cls)


def _walk(module: nn.Module, tree: str, key: str) -> Iterator[Tuple[nn.Module, str, str]]:
    """(module, tree prefix, state-dict prefix) for `module` and everything under it (shared ones
    as often as they occur, like `named_parameters(remove_duplicate=False)`)."""
    yield module, tree, key
    for name, child in module._modules.items():
        if child is None:
            continue
        child_key = key if _drops_child_name(module, name) else key + name + "."
        yield from _walk(child, tree + name + ".", child_key)


def names(model: nn.Module) -> Dict[str, str]:
    """Tree name -> state-dict key, for every parameter and buffer (non-persistent ones included)."""
    out: Dict[str, str] = {}
    for module, tree, key in _walk(model, "", ""):
        for local, value in list(module._parameters.items()) + list(module._buffers.items()):
            if value is not None:
                out[tree + local] = key + local
    return out


def key_of(table: Dict[str, str], tree_name: str) -> str:
    """The state-dict key of the parameter or buffer at `tree_name` (an error naming it if none)."""
    try:
        return table[tree_name]
    except KeyError:
        raise ValueError(f"{tree_name!r} is not a parameter or buffer of the model; its state-dict key is "
                         "unknown") from None


def buffers(model: nn.Module, persistent_only: bool = True) -> Dict[str, torch.Tensor]:
    """The buffers by state-dict key: those `model.state_dict()` holds, or with `persistent_only=False`
    those of `model.named_buffers()` (non-persistent ones too, a shared one once), renamed to keys."""
    if not persistent_only:
        table = names(model)
        return {key_of(table, name): b for name, b in model.named_buffers()}
    out: Dict[str, torch.Tensor] = {}
    for module, _, key in _walk(model, "", ""):
        for local, b in module._buffers.items():
            if b is not None and local not in module._non_persistent_buffers_set:
                out[key + local] = b
    return out


def check_against_state_dict(model: nn.Module, keys: Iterable[str], what: str) -> list:
    """`model.state_dict()`'s keys, in order, after checking that `keys` are exactly those; an error
    naming every key that one side has and the other lacks (nothing is dropped silently)."""
    order = list(model.state_dict().keys())
    have = set(keys)
    missing = [k for k in order if k not in have]
    extra = sorted(have - set(order))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"model.state_dict() has {missing} which {what} cannot produce (neither a sharded "
                         "parameter nor a buffer; e.g. extra state or a key added by a state_dict hook)")
        if extra:
            parts.append(f"{what} has {extra} which model.state_dict() lacks (a wrapper renames keys in a way "
                         "xla_fsdp does not know)")
        raise ValueError(f"{what}: keys do not match the model's state_dict(): {'; '.join(parts)}")
    return order
