"""Deferred construction of modules and their later materialization.

``deferred_init`` returns the module its function built, with every parameter and buffer a meta tensor of the right
shape, dtype, class and ``requires_grad``, and a recorded history (``InitGraph``) behind it. ``materialize_module``
replays that history for the tensors it visits and swaps real tensors in.  Module-level bookkeeping lives in a weak side
table, never on the tensors themselves."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional, TypeVar

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from .graph import DeferredInitError, InitGraph, TensorRef
from .recorder import RecordingMode

M = TypeVar("M", bound=nn.Module)


@dataclasses.dataclass
class _Entry:
    graph: InitGraph
    ref: TensorRef
    # The meta storage the tensor had when recording ended; a different one at materialization means someone replaced it
    # (``.to()``, ``.data =``).
    storage_address: int
    replacement: Optional[torch.Tensor] = None


# tensor -> _Entry, for every deferred tensor ever handed out (weakly held).
_ENTRIES = WeakTensorKeyDictionary()
# graph -> {tensor -> _Entry} for the tensors of that graph still deferred.
_PENDING: "weakref.WeakKeyDictionary[InitGraph, WeakTensorKeyDictionary]" = weakref.WeakKeyDictionary()


def deferred_init(module_fn: Callable[..., M], *args, **kwargs) -> M:
    """Build ``module_fn(*args, **kwargs)`` without allocating tensor memory.

    Every parameter and buffer of the returned module is a meta tensor whose construction (factory op, in-place init,
    copies, ties) was recorded, so ``materialize_module`` can later reproduce it on the host.  Tensors the constructor
    built from Python data (``torch.tensor([...])``) stay real."""
    label = getattr(module_fn, "__qualname__", None) or repr(module_fn)
    graph = InitGraph(label)
    mode = RecordingMode(graph)
    try:
        with mode:
            module = module_fn(*args, **kwargs)
    except DeferredInitError:
        raise
    except Exception as exc:
        exc.add_note(f"raised inside xla_fsdp.deferred_init({label}): tensors created there are meta tensors without "
                     "values")
        raise
    if not isinstance(module, nn.Module):
        raise TypeError(f"deferred_init({label}) expects a function that returns an nn.Module, got "
                        f"{type(module).__name__}.")
    pending = WeakTensorKeyDictionary()
    for sub in module.modules():
        for tensor in (*sub._parameters.values(), *sub._buffers.values()):
            if tensor is None or not tensor.is_meta or tensor in pending:
                continue
            sid = mode.storage_id(tensor)
            if sid is None:
                continue  # a meta tensor from elsewhere: not ours to replay
            entry = _Entry(graph, mode.ref(tensor, sid), tensor.untyped_storage()._cdata)
            _ENTRIES[tensor] = entry
            pending[tensor] = entry
    mode.release()
    _PENDING[graph] = pending
    return module


def is_deferred(obj) -> bool:
    """True for a deferred (meta placeholder) tensor, or a module holding one."""
    if isinstance(obj, nn.Module):
        return any(is_deferred(t) for t in (*obj.parameters(), *obj.buffers()))
    if isinstance(obj, torch.Tensor):
        # A placeholder stays deferred even after a tied alias elsewhere was materialized: the module holding it still
        # has no real tensor.
        return obj in _ENTRIES
    raise TypeError(f"is_deferred expects a torch.Tensor or nn.Module, got {type(obj).__name__}.")


def materialize_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The real tensor for ``tensor``; a real tensor is returned unchanged."""
    entry = _ENTRIES.get(tensor)
    if entry is None:
        return tensor
    if entry.replacement is None:
        _materialize([("tensor", tensor, entry)])
    return entry.replacement


def materialize_module(module: nn.Module, buffers_only: bool = False,
                       check_fn: Optional[Callable[[nn.Module], bool]] = None) -> None:
    """Replace the deferred tensors of ``module`` and its descendants by real ones.

    torchdistx semantics: every descendant is visited; ``check_fn(m)`` False only leaves ``m``'s *own* parameters and
    buffers deferred.  All tensors visited are replayed together, in recorded order, so tensors that share storage (tied
    weights, views) come back sharing it, and a call covering a whole model reproduces eager construction exactly."""
    targets = []  # (qualified name, owning dict, key, tensor, entry)

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, child in mod.named_children():
            visit(child, f"{prefix}{name}.")
        if check_fn is not None and not check_fn(mod):
            return
        owned = [mod._buffers] if buffers_only else [mod._parameters, mod._buffers]
        for table in owned:
            for key, tensor in table.items():
                entry = _ENTRIES.get(tensor) if tensor is not None else None
                if entry is not None:
                    targets.append((f"{prefix}{key}", table, key, tensor, entry))

    visit(module, "")
    _materialize([(name, tensor, entry) for name, _, _, tensor, entry in targets])
    for _, table, key, _, entry in targets:
        table[key] = entry.replacement


def _materialize(targets) -> None:
    """Replay every not-yet-materialized target, one replay per graph."""
    by_graph: dict[int, list] = {}
    seen: set[int] = set()
    for name, tensor, entry in targets:
        if entry.replacement is not None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        _check_unchanged(name, tensor, entry)
        by_graph.setdefault(id(entry.graph), []).append((name, tensor, entry))

    for group in by_graph.values():
        graph = group[0][2].graph
        pending = _PENDING[graph]
        in_group = {id(t) for _, t, _ in group}
        covers_all = all(id(t) in in_group for t in pending.keys())
        try:
            reals = graph.replay([e.ref for _, _, e in group], with_orphan_random=covers_all)
        except DeferredInitError as exc:
            names = ", ".join(repr(n) for n, _, _ in group[:4])
            more = f" and {len(group) - 4} more" if len(group) > 4 else ""
            exc.add_note(f"while materializing {names}{more}")
            raise
        for (_, tensor, entry), real in zip(group, reals):
            entry.replacement = _like(tensor, real)
            del pending[tensor]
        graph.prune({e.ref.storage for e in pending.values()})


def _check_unchanged(name: str, tensor: torch.Tensor, entry: _Entry) -> None:
    ref = entry.ref
    same = (tensor.is_meta and tensor.untyped_storage()._cdata == entry.storage_address
            and tensor.dtype == ref.dtype and tuple(tensor.shape) == ref.size
            and tuple(tensor.stride()) == ref.stride and tensor.storage_offset() == ref.offset)
    if not same:
        raise DeferredInitError(
            f"materialize_module: deferred tensor '{name}' was replaced or reshaped after deferred_init returned "
            "(e.g. by .to(), .half() or assigning .data); ops outside deferred_init are not recorded. Materialize "
            "first and convert afterwards, or do the conversion inside the function passed to deferred_init.")


def _like(old: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``real`` dressed as ``old``: same class, requires_grad and attributes."""
    if isinstance(old, nn.Parameter):
        new = torch.Tensor._make_subclass(type(old), real, old.requires_grad)
    else:
        new = real.requires_grad_(old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new
