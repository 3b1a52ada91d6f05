"""torch_xla 2.9's `SpmdFullyShardedDataParallel` (FSDPv2) on the GSPMD engine.

[Note: FSDPv2 on the GSPMD engine] torch_xla's FSDPv2 is a wrapper module: it marks every parameter of its module that
carries no sharding yet as split over the mesh axis "fsdp", marks its output as split along the batch (`shard_output`),
and nests: `auto_wrap_policy` picks units, each wrapped by `auto_wrapper_callable(unit, mesh=, shard_output=)` (default:
the class itself). Ours trains the same way with the model as its own wrapper ([Note: no wrapper module] in
xla_fsdp/api.py):

- the root call runs the GSPMD engine once (`apply_spmd_fsdp`) with the units the policy picks and the batch split over
  "fsdp" and `extra_data_axis` (torch_xla's axes; other mesh axes hold replicas). The engine calls the
  `auto_wrapper_callable` on each unit, and this class called from inside it (torch_xla's `FSDPv2(checkpoint_module(m),
  *args, **kwargs)`) records the unit instead of sharding it a second time;
- then the root and each recorded unit become instances of this class (so of `XlaFullyShardedDataParallel`) and run
  their `shard_output` after each forward (outputs.py);
- torch_xla's `checkpoint_module` on the root or a recorded unit becomes the engine's own recomputation
  (xla_fsdp/activation_checkpoint.py).

Differences that change no value: parameters are split on dim 0 (torch_xla splits each one's largest dim); the engine
also pins activations inside units to the batch split ([Note: why annotate activations]); torch_xla's per-wrapper
backward optimization barrier is not placed; state-dict keys are the model's own (no `_orig_module.` per wrapper).
torch_xla's nesting (children wrapped first, then the root) works: the root's engine run takes the children as they are
and shards what they leave (`applied_units`). What the engine cannot do torch_xla's way is refused by name: children
over another mesh or batch split, children and a root policy together, an inner call with its own `auto_wrap_policy`,
mesh or `extra_data_axis`, and torch_xla's own FSDP wrappers inside."""
from __future__ import annotations

import difflib
import threading
import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch.nn as nn

from ..api import GspmdFullyShardedDataParallel, XlaFullyShardedDataParallel
from ..class_swap import mix_into, original_class
from ..deferred.tied_embeddings import retie
from ..forward_overrides import restore, take_torch_xla_checkpoint
from ..keywords.resolve import DEFAULTS
from ..options import FSDP_AXIS
from ..unit_state import is_unit
from . import outputs

NAME = "SpmdFullyShardedDataParallel"
ARGUMENTS = ("mesh", "shard_output", "auto_wrap_policy", "auto_wrapper_callable", "extra_data_axis")
_building = threading.local()  # .root: the root call whose auto_wrapper_callable is running


class SpmdFullyShardedDataParallel(GspmdFullyShardedDataParallel):
    """torch_xla's `SpmdFullyShardedDataParallel(module, mesh=None, shard_output=None, auto_wrap_policy=None,
    auto_wrapper_callable=None, extra_data_axis=None)` on the GSPMD engine ([Note: FSDPv2 on the GSPMD engine]). `mesh`
    defaults to torch_xla's global mesh (`xs.set_global_mesh`) and needs an axis named "fsdp"; the batch is split over
    "fsdp" and `extra_data_axis`. Returns `module` itself; `.module` is the model too."""

    def __new__(cls, module: nn.Module = None, mesh=None, shard_output: Optional[Callable] = None,
                auto_wrap_policy: Optional[Callable] = None, auto_wrapper_callable: Optional[Callable] = None,
                extra_data_axis: Optional[str] = None, **kwargs):
        if kwargs:
            raise TypeError(_unknown_arguments(kwargs))
        root = getattr(_building, "root", None)
        if root is not None:  # called by the root's auto_wrapper_callable
            return root.inner_call(module, mesh, shard_output, auto_wrap_policy, extra_data_axis)
        if isinstance(module, nn.Module):
            retie(module)  # [Note: ties lost on the way to the device]
        return _Root(module, mesh, shard_output, auto_wrap_policy, auto_wrapper_callable, extra_data_axis).apply(cls)

    def __init__(self, *args, **kwargs):  # noqa: D107 - made in __new__
        pass

    # torch_xla's wrapper keeps the module it wraps and its mesh under these names, and scripts read them; here the
    # model is its own wrapper
    @property
    def _orig_module(self) -> nn.Module:
        return self

    @property
    def _mesh(self):
        return self._fsdp_mesh


class _Root:
    """One root call: its checked arguments, and the units its auto_wrapper_callable records."""

    def __init__(self, module, mesh, shard_output, policy, wrapper, extra_data_axis):
        # every check before anything changes: an error leaves the model as it was
        _check_module(module)
        _check_callables(shard_output=shard_output, auto_wrap_policy=policy, auto_wrapper_callable=wrapper)
        self.mesh = _mesh(mesh)
        self.batch_axes = _batch_axes(self.mesh, extra_data_axis)
        from ..runtime.slices import check_within_slices

        check_within_slices(self.mesh, FSDP_AXIS, NAME)
        self.children = _wrapped_children(module, self.mesh, self.batch_axes, policy)
        from ..runtime.choice import check_spmd_came_first

        check_spmd_came_first(NAME)
        if "module" in module._modules:
            warnings.warn(f"{type(module).__name__} has a child named 'module'. torch_xla's wrapper's `.module` is "
                          "the whole model; here the model is its own wrapper and `model.module` stays that child: use "
                          "`model` itself for the whole model")
        self.module, self.shard_output, self.policy, self.wrapper = module, shard_output, policy, wrapper
        self.units: List[Tuple[nn.Module, Optional[Callable]]] = []  # recorded inner units, their shard_output
        self.pending: List[Tuple[nn.Module, Optional[Callable]]] = []
        self.taken: List[Tuple[nn.Module, dict]] = []  # torch_xla checkpoints taken off, for `restore`

    def apply(self, door: type) -> nn.Module:
        from ..gspmd_engine.activations import checkpoint_unit
        from ..gspmd_engine.engine import apply_spmd_fsdp

        self.door = door
        self._take_checkpoint(self.module)
        _building.root = self
        try:
            apply_spmd_fsdp(self.module, mesh=self.mesh, auto_wrap_policy=self.policy,
                            auto_wrapper_callable=self._wrap_unit if self.policy is not None else None,
                            batch_axes=self.batch_axes, applied_units=self.children)
        except BaseException:
            for module, removed in self.taken:
                restore(module, removed)
            raise
        finally:
            _building.root = None
        checkpointed = {id(m) for m, _ in self.taken}
        for unit, shard_output in self.units + [(self.module, self.shard_output)]:
            mix_into(unit, door, "FSDP")
            unit._fsdp_mesh, unit._fsdp_batch_axes = self.mesh, self.batch_axes
            outputs.install(unit, shard_output, self.mesh, self.batch_axes)
            if id(unit) in checkpointed:
                checkpoint_unit(unit, None)
        self.module._fsdpv2_call_root = True  # a later root call over it takes it as one of its units
        return self.module

    def _wrap_unit(self, unit: nn.Module) -> nn.Module:
        """The engine's one-argument wrapper: torch_xla's call of `auto_wrapper_callable`."""
        self.pending = []
        result = (self.wrapper or self.door)(unit, mesh=self.mesh, shard_output=self.shard_output)
        if isinstance(result, nn.Module) and _is_torch_xla_wrapper(result):
            raise ValueError(
                f"auto_wrapper_callable returned torch_xla's {type(result).__name__} for {type(unit).__name__}; "
                f"swap every import of torch_xla's FSDP classes for xla_fsdp's ({NAME})")
        for module, _ in self.pending:
            if module is not result:
                raise ValueError(
                    f"auto_wrapper_callable called {NAME} on {type(module).__name__} but returned "
                    f"{type(result).__name__} for unit {type(unit).__name__}; it must return what {NAME} returned")
        self.units.extend(self.pending)
        return result

    def inner_call(self, module, mesh, shard_output, policy, extra_data_axis) -> nn.Module:
        """`SpmdFullyShardedDataParallel(unit, ...)` inside the root's auto_wrapper_callable: record the unit (the
        root's engine run shards it)."""
        _check_module(module)
        _check_callables(shard_output=shard_output)
        if policy is not None:
            raise ValueError(f"{NAME} inside auto_wrapper_callable got an auto_wrap_policy; the root's policy picks "
                             "every unit: give the root a policy that picks the inner modules too")
        if not _same_mesh(_mesh(mesh), self.mesh):
            raise ValueError(f"{NAME} inside auto_wrapper_callable got another mesh than the root's; every unit is "
                             "sharded over the root's mesh: pass it the mesh it is given (mesh=mesh)")
        if extra_data_axis and _batch_axes(self.mesh, extra_data_axis) != self.batch_axes:
            raise ValueError(f"{NAME} inside auto_wrapper_callable got extra_data_axis={extra_data_axis!r}, the root "
                             f"splits the batch over {self.batch_axes}; give extra_data_axis to the root only")
        self._take_checkpoint(module)
        self.pending.append((module, shard_output))
        return module

    def _take_checkpoint(self, module: nn.Module) -> None:
        removed = take_torch_xla_checkpoint(module)
        if removed is not None:
            self.taken.append((module, removed))


def _wrapped_children(module: nn.Module, mesh, batch_axes, policy) -> List[nn.Module]:
    """Modules inside `module` an earlier call of this class sharded as its root, outermost first (torch_xla's nesting:
    `model.fc1 = FSDPv2(model.fc1, mesh=mesh)`, ..., then `FSDPv2(model, mesh=mesh)`): the root's call takes them as
    they are and shards what they leave. Any other wrapper inside is refused, and so is a child over another mesh or
    batch split."""
    children, taken, other = [], set(), []
    for name, m in module.named_modules():
        if m is module or id(m) in taken:
            continue
        if getattr(m, "_fsdpv2_call_root", False) and isinstance(m, SpmdFullyShardedDataParallel):
            if not _same_mesh(m._fsdp_mesh, mesh) or tuple(m._fsdp_batch_axes) != tuple(batch_axes):
                raise ValueError(
                    f"{name} ({original_class(m).__name__}) was wrapped by {NAME} over another mesh or batch split "
                    f"(extra_data_axis) than {type(module).__name__}'s; every part of a model is sharded over one "
                    "mesh: pass the same mesh= and extra_data_axis= to every call")
            children.append(m)
            taken.update(id(inner) for inner in m.modules())
        elif _is_wrapped(m):
            other.append(f"{name} ({original_class(m).__name__})")
    if other:
        raise ValueError(f"{', '.join(other)} inside {type(module).__name__} is already wrapped; xla_fsdp shards a "
                         "model once, from its root: drop the inner call and give the root an auto_wrap_policy that "
                         "picks that module (e.g. transformer_auto_wrap_policy with its class)")
    if children and policy is not None:
        names = ", ".join(original_class(c).__name__ for c in children)
        raise ValueError(f"{type(module).__name__} holds modules {NAME} already wrapped ({names}) and was given an "
                         "auto_wrap_policy; xla_fsdp takes one of the two: wrap the children yourself and the root "
                         "without a policy, or only the root with a policy that picks them")
    return children


def _unknown_arguments(kwargs) -> str:
    hints = []
    for key in sorted(kwargs):
        close = difflib.get_close_matches(key, ARGUMENTS, 1)
        if close:
            hints.append(f"{key!r} (did you mean {close[0]!r}?)")
        elif key in DEFAULTS:
            hints.append(f"{key!r} (an XlaFullyShardedDataParallel keyword: use "
                         f"XlaFullyShardedDataParallel(module, engine='spmd', {key}=...))")
        else:
            hints.append(repr(key))
    return (f"{NAME} got unexpected keyword argument(s) {', '.join(hints)}; it takes torch_xla's: "
            f"module, {', '.join(ARGUMENTS)}")


def _check_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{NAME} expects an nn.Module, got {type(module).__name__}")
    if _is_wrapped(module):
        raise RuntimeError(f"{original_class(module).__name__} is already wrapped; wrap each module once "
                           "(an auto_wrap_policy skips wrapped children)")
    if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:
        raise RuntimeError(f"{type(module).__name__} has no forward(); {NAME} wraps a module that defines one and "
                           "is called through it: wrap its children (each layer of a ModuleList) or its parent")


def _check_callables(**given) -> None:
    for name, value in given.items():
        if value is not None and not callable(value):
            raise TypeError(f"{NAME}'s {name} must be callable or None, got {type(value).__name__}")


def _is_wrapped(module: nn.Module) -> bool:
    return isinstance(module, XlaFullyShardedDataParallel) or is_unit(module) or _is_torch_xla_wrapper(module)


def _is_torch_xla_wrapper(module: nn.Module) -> bool:
    return any(c.__module__.startswith("torch_xla.") and c.__name__.endswith("FullyShardedDataParallel")
               for c in type(module).__mro__)


def _mesh(mesh):
    """`mesh`, or torch_xla's global mesh, checked for an "fsdp" axis (torch_xla's rules)."""
    import torch_xla.distributed.spmd as xs

    if mesh is None:
        mesh = xs.get_global_mesh()
        if mesh is None:
            raise ValueError(f"{NAME} got no mesh and no global mesh is set: call xs.set_global_mesh(xs.Mesh("
                             "device_ids, mesh_shape, ('fsdp', ...))) before wrapping, or pass mesh=")
    if not isinstance(mesh, xs.Mesh):
        raise TypeError(f"{NAME}'s mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
    if FSDP_AXIS not in tuple(mesh.axis_names or ()):
        raise ValueError(f"{NAME}'s mesh has axes {mesh.axis_names}, none named {FSDP_AXIS!r}; parameters are split "
                         f"over the axis named {FSDP_AXIS!r}: name one mesh axis {FSDP_AXIS!r}")
    return mesh


def _batch_axes(mesh, extra_data_axis) -> Tuple[str, ...]:
    """The axes the batch is split over: torch_xla's `(extra_data_axis, "fsdp")`, or "fsdp"."""
    if not extra_data_axis:
        return (FSDP_AXIS,)
    if not isinstance(extra_data_axis, str) or extra_data_axis not in tuple(mesh.axis_names):
        # torch_xla's own words first, so a script that matches them still does
        raise ValueError(f"The provided {extra_data_axis} axis is not in the mesh. extra_data_axis "
                         f"{extra_data_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}; name the mesh "
                         "axis the batch is split over besides 'fsdp'")
    if extra_data_axis == FSDP_AXIS:
        raise ValueError(f"extra_data_axis is the axis the batch is split over besides {FSDP_AXIS!r}, not "
                         f"{FSDP_AXIS!r} itself; leave it None to split the batch over {FSDP_AXIS!r} alone")
    return (extra_data_axis, FSDP_AXIS)


def _same_mesh(a, b) -> bool:
    return a is b or (list(a.device_ids) == list(b.device_ids) and tuple(a.mesh_shape) == tuple(b.mesh_shape)
                      and tuple(a.axis_names) == tuple(b.axis_names))
