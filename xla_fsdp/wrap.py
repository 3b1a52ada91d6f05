"""Auto-wrap policies and the recursive wrapper.

A policy is called as `policy(module, recurse, unwrapped_params)`: with `recurse=True` it answers "look inside this
module for units?", with `recurse=False` "make this module a unit?". torch_xla's and older PyTorch policies have the
same shape, so they work here too.

[Note: tied parameters] A parameter registered in two modules (tied input and output embeddings) must live in one unit.
The wrapper never makes a unit of a module whose parameters are also used outside it; such parameters stay in the common
parent. Wrapping by hand in a way that splits them raises an error."""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, Optional, Set, Type, Union

import torch.nn as nn

from .unit_state import is_unit


def always_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, **_) -> bool:
    """Every module with parameters becomes a unit."""
    return True


# The policies take their settings positionally or by keyword, as torch_xla's do (torch_xla.distributed.fsdp.wrap):
# `functools.partial(transformer_auto_wrap_policy, {GPT2Block})` binds transformer_layer_cls as torch_xla's own scripts
# may write it.
def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: Optional[Iterable[type]] = None,
                                exclude_wrap_modules: Optional[Iterable[type]] = None) -> bool:
    """Wrap a module once its not-yet-wrapped parameters reach `min_num_params`; never recurse into `force_leaf_modules`
    nor wrap `exclude_wrap_modules` (None: the defaults below, as torch_xla)."""
    skip = force_leaf_modules if recurse else exclude_wrap_modules
    if skip is None:
        own = size_based_auto_wrap_policy
        skip = own.FORCE_LEAF_MODULES if recurse else own.EXCLUDE_WRAP_MODULES
    # recursing into a module below the threshold could wrap nothing: its children hold fewer parameters
    return unwrapped_params >= min_num_params and not isinstance(module, tuple(skip))


size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                 transformer_layer_cls: Iterable[Union[Type[nn.Module], str]]) -> bool:
    """Wrap every instance of the given layer classes (classes or class names, e.g. ["GPT2Block"])."""
    if recurse:
        return True
    classes = {transformer_layer_cls} if isinstance(transformer_layer_cls, (str, type)) else set(transformer_layer_cls)
    return any(c in classes or c.__name__ in classes for c in type(module).__mro__)


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which `lambda_fn(module)` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_policy(layer_classes) -> Callable:
    """`transformer_auto_wrap_policy` bound to some layer classes (convenience)."""
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(layer_classes))


def _param_users(root: nn.Module) -> Dict[int, Set[int]]:
    """id(param) -> ids of modules that register it."""
    users: Dict[int, Set[int]] = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(id(m))
    return users


def auto_wrap_children(root: nn.Module, kwargs: dict, wrapper_cls: type) -> None:
    """Wrap the children of `root` (bottom-up) that the policy selects, with the same options.

    `wrapper_cls` is the unit class (the front door passes itself, so this module never imports it): the default
    wrapper; a child that is a unit (`unit_state.is_unit`, or an instance of it: the GSPMD engine's) is already wrapped.
    """
    policy = kwargs["auto_wrap_policy"]
    wrapper = kwargs.get("auto_wrapper_callable") or wrapper_cls
    child_kwargs = {k: v for k, v in kwargs.items() if k not in ("auto_wrap_policy", "auto_wrapper_callable", "scan_layers")}
    users = _param_users(root)

    def unwrapped_numel(m: nn.Module) -> int:
        seen, n = set(), 0
        for sub in _unwrapped_modules(m, wrapper_cls):
            for p in sub._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        return n

    def shared_outside(m: nn.Module) -> bool:
        inside = {id(x) for x in m.modules()}
        for sub in m.modules():
            for p in sub._parameters.values():
                if p is not None and not users.get(id(p), set()) <= inside:
                    return True
        return False

    def visit(m: nn.Module):
        for name, child in list(m._modules.items()):
            if child is None or is_unit(child) or isinstance(child, wrapper_cls):
                continue
            if policy(child, True, unwrapped_numel(child)):
                visit(child)
            if (policy(child, False, unwrapped_numel(child)) and unwrapped_numel(child) > 0
                    and type(child).forward is not nn.Module.forward and not shared_outside(child)):
                unit = wrapper(child, **child_kwargs)
                if kwargs.get("activation_checkpointing"):
                    from .activation_checkpoint import checkpoint_module

                    checkpoint_module(unit)
                m._modules[name] = unit

    visit(root)


def _unwrapped_modules(m: nn.Module, wrapper_cls: type):
    yield m
    for child in m._modules.values():
        if child is not None and not (is_unit(child) or isinstance(child, wrapper_cls)):
            yield from _unwrapped_modules(child, wrapper_cls)
