"""Full parameters saved for backward, replaced by tokens while a unit that reshards runs.

[Note: freeing gathered parameters] Autograd normally keeps every tensor an op saves for backward, which would keep each
unit's full parameters alive from forward to backward. While a unit that reshards runs its forward, a saved-tensor hook
replaces any saved full parameter (or a view of one) by a small token. In backward a hook on the unit's outputs gathers
the parameters again (behind an optimization barrier tied to the incoming gradient, so XLA can neither merge this gather
with the forward one nor hoist it), and the token unpacks to the fresh copy (re-applying the view). The reduce-scatter
of the unit's gradients runs in the backward of `_GatherParams`, after which the copy is dropped. On CPU the forward
copy's storage is released at once, so a saved tensor that escaped the hook fails loudly instead of silently costing
memory.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

_local = threading.local()


def registry() -> Dict[int, Tuple[Any, int, torch.Tensor]]:
    if not hasattr(_local, "registry"):
        _local.registry = {}
        _local.active = []
    return _local.registry


def active_units() -> List[Any]:
    registry()
    return _local.active


class _ParamToken:
    """Stands in for a saved full parameter (or a view of one) between forward and backward."""

    __slots__ = ("state", "index", "view_of", "geometry")

    def __init__(self, state: Any, index: int, view_of: Optional[torch.Tensor]):
        self.state, self.index, self.view_of = state, index, view_of
        # CPU bases lose their storage at reshard, after which a view can no longer
        # replay itself; the strided geometry rebuilds it on the fresh contiguous copy
        self.geometry = None
        if view_of is not None and view_of.device.type == "cpu":
            self.geometry = (view_of.size(), view_of.stride(),
                             view_of.storage_offset() - view_of._base.storage_offset())
            self.view_of = None


class _Outer(NamedTuple):
    """A tensor handed to the saved-tensor hooks that were active outside the unit."""

    packed: Any
    unpack: Callable


def make_hooks(outer):
    """Our pack/unpack pair; anything that is not a gathered parameter goes to `outer`
    (hooks active around the unit, e.g. torch.autograd.graph.save_on_cpu), if any."""

    def pack(t: torch.Tensor):
        reg = registry()
        hit = reg.get(id(t))
        if hit is not None and hit[2] is t:
            return _ParamToken(hit[0], hit[1], None)
        base = t._base
        if base is not None:
            hit = reg.get(id(base))
            if hit is not None and hit[2] is base:
                return _ParamToken(hit[0], hit[1], t)
        return _Outer(outer[0](t), outer[1]) if outer is not None else t

    return pack, _unpack


def _unpack(x):
    if isinstance(x, _Outer):
        return x.unpack(x.packed)
    if not isinstance(x, _ParamToken):
        return x
    full = x.state.full_params_for_backward()[x.index]
    if x.geometry is not None:
        return full.as_strided(*x.geometry)
    return full if x.view_of is None else x.view_of._view_func(full)
