"""Forwards that other libraries put on module instances, and what a unit does with them.

[Note: foreign forwards] A unit gathers its parameters in its class's `forward`. An instance attribute `forward` shadows
that method, so the unit would compute with its shards: torch_xla's `checkpoint_module(m)` and its
`apply_xla_patch_to_nn_linear` both set one, and Hugging Face Trainer wraps `FSDP(checkpoint_module(layer))`. At wrap
time a unit's own instance forward is resolved here:

- torch_xla's `checkpoint_module`: removed, and the unit recomputes its whole forward (gather included) in backward, as
  `checkpoint_module` after wrapping does; its saved original forward runs inside the gather;
- torch_xla's patched `nn.Linear` forward, or a `functools.partial` of the module's own forward (a common way to fix
  keyword arguments): kept and run inside the gather (both only read the parameters while they run);
- torch's `CheckpointWrapper` as the unit: its wrapped module runs inside the gather, and the unit recomputes it
  (torch's own recomputation would run after the shards are back in place);
- anything else: an error naming the module, since FSDP cannot tell whether it reads the parameters later (as a
  recomputation does).

A checkpointed module *inside* a unit (not a unit itself) recomputes in backward with the unit's shards in place: also
an error, naming it and the fix. Overrides set after wrapping are checked at every root forward."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch.nn as nn
from .class_swap import original_class
from .unit_state import is_unit, state_of

_XLA_CKPT = "_xla_checkpointed_forward_original"
_XLA_CKPT_HELPER = "_xla_checkpointed_forward_no_kwargs"
_XLA_CKPT_ATTRS = ("forward", _XLA_CKPT, _XLA_CKPT_HELPER)  # what torch_xla's checkpoint_module sets on a module


def _is_torch_xla_patched_linear(fn) -> bool:
    func = getattr(fn, "__func__", None)
    return (isinstance(getattr(fn, "__self__", None), nn.Linear) and func is not None
            and func.__name__ == "_xla_patched_nn_linear_forward"
            and func.__module__.startswith("torch_xla.distributed.fsdp"))


def _is_own_forward(fn, module: nn.Module, cls: type) -> bool:
    """A bound method of `cls.forward` on `module`, possibly inside a functools.partial."""
    if isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__self__", None) is module and getattr(fn, "__func__", None) is cls.forward


def _is_torch_wrapper(module: nn.Module, name: str = "CheckpointWrapper") -> bool:
    """Whether `module` is one of torch's activation wrappers called `name` (CheckpointWrapper, ActivationWrapper)."""
    return any(c.__name__ == name and c.__module__.startswith("torch.distributed.algorithms")
               for c in type(module).__mro__)


def _take_xla_checkpoint(module: nn.Module) -> Dict[str, object]:
    """torch_xla's checkpoint_module attributes, taken off `module`."""
    return {name: module.__dict__.pop(name) for name in _XLA_CKPT_ATTRS if name in module.__dict__}


def _kind(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def adopt(module: nn.Module) -> Tuple[bool, Optional[Callable], Dict[str, object]]:
    """Resolve `module`'s own forward override before it becomes a unit.

    Returns (recompute the unit in backward, the callable to run inside the gather instead of the class's forward or
    None, the instance attributes removed, for `restore`). Raises for what cannot be made correct; then `module` is
    unchanged."""
    cls = type(module)
    if _is_torch_wrapper(module):
        inner = module._checkpoint_wrapped_module
        return True, lambda *args, **kwargs: inner(*args, **kwargs), {}
    if _is_torch_wrapper(module, "ActivationWrapper"):
        raise ValueError(f"{cls.__name__} wraps {type(module._checkpoint_wrapped_module).__name__} to change where "
                         "its activations live; FSDP cannot make it a unit. Wrap the inner module instead")
    override = module.__dict__.get("forward")
    if override is None:
        return False, None, {}
    if _XLA_CKPT in module.__dict__:  # torch_xla's checkpoint_module(m)
        original = module.__dict__[_XLA_CKPT]
        inner = None
        if not _is_own_forward(original, module, cls):
            if not _is_torch_xla_patched_linear(original):
                raise _unknown(module, original)
            inner = original
        return True, inner, _take_xla_checkpoint(module)
    if _is_torch_xla_patched_linear(override) or _is_own_forward(override, module, cls):
        return False, override, {"forward": module.__dict__.pop("forward")}
    raise _unknown(module, override)


def restore(module: nn.Module, removed: Dict[str, object]) -> None:
    """Undo `adopt` or `take_torch_xla_checkpoint` (wrapping failed after it)."""
    module.__dict__.update(removed)


def take_torch_xla_checkpoint(module: nn.Module) -> Optional[Dict[str, object]]:
    """Take torch_xla's `checkpoint_module(module)` off `module`, for an engine that recomputes the module its own way:
    the forward torch_xla wrapped stays (as an instance attribute only if it was one, e.g. a `functools.partial`).
    Returns the attributes removed, for `restore`, or None when `module` was not checkpointed by torch_xla."""
    if _XLA_CKPT not in module.__dict__ or "forward" not in module.__dict__:
        return None
    original = module.__dict__[_XLA_CKPT]
    removed = _take_xla_checkpoint(module)
    if not (getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward):
        module.__dict__["forward"] = original
    return removed


def _unknown(module: nn.Module, fn) -> ValueError:
    return ValueError(
        f"{type(module).__name__} has an instance-level forward ({_kind(fn)}) that replaces its class's forward, "
        "so as a unit it would never gather its parameters, and FSDP cannot tell whether the override reads them "
        "later (as a recomputation does). Remove it and give FSDP the plain module (use activation_checkpointing="
        "True or xla_fsdp.checkpoint_module for recomputation), or subclass and override forward()")


def checkpointed_inside(root: nn.Module, is_unit: Callable[[nn.Module], bool]) -> List[str]:
    """Modules strictly inside `root`'s own part (not in nested units) that recompute in backward."""
    found = []
    stack = [(n, c) for n, c in root.named_children()]
    while stack:
        name, m = stack.pop()
        if is_unit(m):
            continue
        if _XLA_CKPT in m.__dict__ or _is_torch_wrapper(m):
            found.append(f"{name} ({type(m).__name__})")
            continue
        stack.extend((f"{name}.{n}", c) for n, c in m.named_children())
    return sorted(found)


def convert_checkpoint_after_wrapping(unit: nn.Module) -> bool:
    """torch_xla's checkpoint_module(unit) after wrapping -> the unit's own recomputation.

    torch_xla's recomputation would call the unit's forward again (which gathers), but it keeps Hugging Face's KV cache
    in the call, so recomputed attention sees its keys twice; the unit's own recomputation drops the cache and starts
    behind an optimization barrier. Called by the root for every unit before its forward (a unit's own call has bound
    its forward already)."""
    original = unit.__dict__.get(_XLA_CKPT)
    if "forward" not in unit.__dict__ or original is None or \
            getattr(original, "__func__", None) is not type(unit).forward:
        return False
    _take_xla_checkpoint(unit)
    state_of(unit).checkpointed = True
    return True


def _call_wrapped(module: nn.Module, *args, **kwargs):
    return module(*args, **kwargs)


def convert_checkpoint_wrappers_around_units(root: nn.Module) -> int:
    """torch's CheckpointWrapper put around a unit after wrapping (FSDP2 scripts' `apply_activation_checkpointing` after
    `fully_shard`) -> the unit's own recomputation.

    torch's recomputation cannot run on XLA (torch.utils.checkpoint looks for a `torch.xla` device module), and it would
    recompute with whatever the unit registers outside its forward; the unit's own recomputation gathers again, as
    FSDP2's does on GPUs. The wrapper stays (its state-dict keys are handled) and calls the unit directly. Returns how
    many."""
    converted = 0
    for m in root.modules():
        inner = getattr(m, "_checkpoint_wrapped_module", None)
        if _is_torch_wrapper(m) and inner is not None and is_unit(inner) \
                and m.__dict__.get("checkpoint_fn") is not _call_wrapped:
            m.checkpoint_fn = _call_wrapped
            state_of(inner).checkpointed = True
            converted += 1
    return converted


def guard(unit: nn.Module, args) -> None:
    """Forward pre-hook of every unit: refuse an instance forward set after wrapping (it would run instead of the
    gather), except torch_xla's checkpoint_module(unit), which the root converts before its next forward (see
    `convert_checkpoint_after_wrapping`)."""
    override = unit.__dict__.get("forward")
    if override is None:
        return
    original = unit.__dict__.get(_XLA_CKPT)
    if original is not None and getattr(original, "__func__", None) is type(unit).forward:
        return
    raise RuntimeError(
        f"{original_class(unit).__name__} was given an instance-level forward ({_kind(override)}) after it was "
        "wrapped by XlaFullyShardedDataParallel; it replaces the unit's forward, which gathers the parameters, "
        "so it would compute with shards. Set it before wrapping (torch_xla's checkpoint_module and patched "
        "Linear are handled there) or remove it")
