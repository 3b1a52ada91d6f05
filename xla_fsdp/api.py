"""The public front door: `XlaFullyShardedDataParallel` (alias `FSDP`).

It accepts torch_xla's keyword names, so switching from `torch_xla.distributed.fsdp.XlaFullyShardedDataParallel` is an
import change.

[Note: no wrapper module] Like PyTorch's FSDP2, wrapping does not put the module inside a container:
`XlaFullyShardedDataParallel(m)` returns `m` itself with its class swapped to a subclass of both
`XlaFullyShardedDataParallel` and `type(m)`. Parameter names and state-dict keys stay those of the unwrapped model,
`isinstance(m, XlaFullyShardedDataParallel)` holds, and `m.parameters()` yields the local shards."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .class_swap import mix_into, original_class, unmix
from .memory.remat_policy import set_policy
from .deferred.tied_embeddings import retie
from .keywords.resolve import DEFAULTS, SPMD_KEYWORDS, build_options, resolve
from .options import ShardingLayout, TrainingState
from .unit_state import is_unit, register, state_of, units, unregister


ALIASES = {TrainingState.PRE_BACKWARD.name: {"BACKWARD_PRE", "BACKWARD_POST"}}  # torch_xla's, for assert_state


class UnitMethods(nn.Module):
    """What both front doors' units share (`XlaFullyShardedDataParallel` and FSDP2's `FSDPModule`): the forward through
    the unit's engine state and the methods that act on that state alone. Each reads the unit's state with `state_of`
    ([Note: one engine state per unit])."""

    def forward(self, *args, **kwargs):
        state = state_of(self)
        run = state.inner_forward or super().forward
        if state.checkpointed and not state.keeps_activations:
            from .activation_checkpoint import checkpointed_call

            return checkpointed_call(lambda *a, **k: state.forward(run, a, k, self), args, kwargs, self)
        return state.forward(run, args, kwargs, self)

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """This unit's parameters whole until `reshard()` (not its child units'); with one process per device every rank
        calls it (it gathers). Under `torch.no_grad()` a forward computes with the whole parameters; under autograd a
        `fully_shard` unit's forward gathers as usual, an `XlaFullyShardedDataParallel` unit's refuses. `async_op=True`
        returns an `UnshardHandle` (FSDP2's). A GSPMD engine unit has nothing to gather (global tensors)."""
        state = state_of(self)
        if state is not None:
            state.unshard()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Back to the shards after `unshard()`."""
        state = state_of(self)
        if state is not None:
            state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: with False, backward reduces nothing and each rank accumulates full gradients (full-size
        memory) until a backward with True reduces them all together. The XLA-friendly alternative keeps it True: each
        backward reduce-scatters and the shard gradients accumulate, 1/N the memory for a collective per micro-batch."""
        for unit in units(self) if recurse else [self]:
            state_of(unit).group.requires_grad_sync = bool(requires_gradient_sync)

    @property
    def device_mesh(self):
        """The mesh this unit is sharded over: FSDP2's 1-D `DeviceMesh("xla")` for a `fully_shard` unit; for an
        `XlaFullyShardedDataParallel` unit the single-controller runtime's torch_xla mesh (None with one process per
        device)."""
        return state_of(self).device_mesh

    def extra_repr(self) -> str:
        layout = state_of(self).group.comm.layout
        return (f"[xla_fsdp unit: {len(state_of(self).group.params)} params, "
                f"shard {layout.shard_rank}/{layout.shard_world_size}]")


class UnshardHandle:
    """What `unshard(async_op=True)` returns. `wait()` returns at once: the gather is an operation of the traced
    program, which XLA orders by its data dependencies."""
    def wait(self) -> None:
        return None


class XlaFullyShardedDataParallel(UnitMethods):
    """Shard every parameter of `module` on dim 0 across the sharding group.

    See docs/migration.md for the keywords. Returns `module` itself (see [Note: no wrapper module])."""

    def __new__(cls, module: nn.Module = None, *args, **kwargs):
        if args:
            raise TypeError("XlaFullyShardedDataParallel takes the module positionally and options as keywords")
        if not isinstance(module, nn.Module):
            raise TypeError(f"XlaFullyShardedDataParallel expects an nn.Module, got {type(module).__name__}")
        unknown = sorted(set(kwargs) - set(DEFAULTS))
        if unknown:
            import difflib

            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, DEFAULTS, 1))
                     else repr(k) for k in unknown]
            raise TypeError(f"XlaFullyShardedDataParallel got unexpected keyword argument(s): {', '.join(hints)}")
        if isinstance(module, XlaFullyShardedDataParallel) or is_unit(module):
            door = "XlaFullyShardedDataParallel" if isinstance(module, XlaFullyShardedDataParallel) else "fully_shard"
            raise ValueError(f"{original_class(module).__name__} is already wrapped by {door}; wrap each module once "
                             "(auto_wrap_policy skips wrapped children)")
        if type(module).forward is nn.Module.forward:
            raise ValueError(f"{type(module).__name__} has no forward(), so it can never gather its parameters; wrap "
                             "its children (e.g. each layer of a ModuleList) or the module that calls them")
        retie(module)  # [Note: ties lost on the way to the device]
        if kwargs.get("engine", "collectives") == "spmd":
            return _apply_spmd(module, kwargs)
        make_unit(module, kwargs, cls)
        return module

    def __init__(self, module: nn.Module, **kwargs):  # noqa: D107 - made a unit in __new__
        pass

    def enable_activation_checkpointing(self) -> None:
        """Recompute this unit's whole forward (gather, compute, free) in backward, as `checkpoint_module(unit)`."""
        state_of(self).checkpointed = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
        """Clip gradients of all shards of all units so their global norm is at most `max_norm`.

        `groups` (torch_xla's keyword): lists of ranks over which the norm is summed, for FSDP mixed with model
        parallelism; default the sharding group."""
        from .collective_engine.clip_grad import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type, groups)

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True):
        """PyTorch FSDP's context with every parameter whole (of all units below, with `recurse`), e.g. to evaluate or
        generate without per-layer gathers. With `writeback`, in-place changes to the full parameters are kept.
        Collective: every rank enters it."""
        states = [state_of(u) for u in (units(self) if recurse else [self])]
        for state in states:
            state.unshard()
        try:
            yield
        finally:
            for state in states:
                state.reshard(writeback)

    @contextlib.contextmanager
    def no_sync(self):
        """torch_xla's (and Accelerate's) gradient accumulation: inside, backward skips all communication and
        accumulates full gradients; the first backward after it reduces."""
        if state_of(self).is_root is False:
            raise RuntimeError(f"no_sync() must be called on the root unit, not on {original_class(self).__name__}")
        groups = [state_of(u).group for u in units(self)]
        before = [g.requires_grad_sync for g in groups]
        for g in groups:
            g.requires_grad_sync = False
        try:
            yield
        finally:
            for g, value in zip(groups, before):
                g.requires_grad_sync = value

    def get_shard_metadata(self) -> dict:
        """How this rank's `state_dict()` is sharded (torch_xla's name); saved next to it, it lets
        `xla_fsdp.consolidate_sharded_model_checkpoints` rebuild the full model."""
        from .collective_engine.model_state import shard_metadata

        return shard_metadata(self)

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """torch_xla's: reduced gradients become the sum over the ranks that reduce together divided by `pre` (before
        the reduction) and `post` (after), each only when above 1; (1, 1) is the default average. With `recursive`, the
        units below too. On the single controller a rank is a process (host), as in FSDP2's
        `set_gradient_divide_factor`."""
        if state_of(self).training_state != TrainingState.IDLE:
            raise ValueError("set_gradient_divide_factors is called between steps, not during forward or backward")
        divisor = (pre if pre > 1 else 1.0) * (post if post > 1 else 1.0)
        for unit in units(self) if recursive else [self]:
            group = state_of(unit).group
            comm = group.comm
            if comm.is_single_controller:
                import torch_xla.runtime as xr

                ranks = xr.process_count()
            else:
                ranks = 1.0 / comm.grad_scale(group.across_replicas)
            group.grad_factor = 1.0 if (pre, post) == (1, 1) else ranks / divisor

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        """torch_xla's: the parameters (local shards) that have a gradient."""
        return [p for p in self.parameters() if p.grad is not None]

    def get_original_names_and_sharded_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """torch_xla's: (original name, sharded parameter) pairs; here `named_parameters()` already has the original
        names ([Note: no wrapper module])."""
        return list(self.named_parameters())

    def assert_state(self, state) -> None:
        """torch_xla's: raise ValueError unless this unit is in `state`, a training state (ours or torch_xla's
        `TrainingState`, by name) or a list of them."""
        wanted = list(state) if isinstance(state, (list, tuple)) else [state]
        unit = state_of(self)
        now = {unit.training_state.name} | ALIASES.get(unit.training_state.name, set())
        if unit.unsharded is not None:
            now.add("SUMMON_FULL_PARAMS")
        if not now & {getattr(s, "name", s) for s in wanted}:
            raise ValueError(f"expected to be in states {wanted} but current state is {unit.training_state}")

    @property
    def module(self) -> nn.Module:
        """The module itself: torch_xla's FSDP wraps it in `.module`, here the module is the wrapper. A child named
        "module" of the user's model keeps its name."""
        child = self._modules.get("module")
        return child if child is not None else self

    @property
    def sharding_layout(self) -> ShardingLayout:
        return state_of(self).group.comm.layout


def make_unit(module: Union[nn.Module, Sequence[nn.Module]], kwargs: Dict[str, Any], door: type, *,
              param_cls: type = nn.Parameter, keeps_meta: bool = False, ignored: frozenset = frozenset()):
    """Make `module` (or several modules: one unit, [Note: a unit of several modules]) a unit of the collective engine
    in place, behind front door `door` (a class mixed into the module's own): adopt forwards other libraries set on it,
    build its engine state from the engine keywords `kwargs` and register it ([Note: one engine state per unit]).
    Returns the state. `param_cls` is the class of its sharded parameters; with `keeps_meta` a meta module stays on the
    meta device until it is given storage (FSDP2's `to_empty()`); `ignored` holds the ids of parameters it leaves alone
    (FSDP2's `ignored_params`). On any error the modules are left as they were (nothing half-wrapped)."""
    from .activation_checkpoint import strip_checkpoint
    from .forward_overrides import adopt, restore

    modules = [module] if isinstance(module, nn.Module) else list(module)
    entered = []
    try:
        for m in modules:
            recompute, inner, removed = adopt(m)  # see [Note: foreign forwards]
            entered.append((m, removed))
            checkpointed = strip_checkpoint(m) or recompute  # FSDP(checkpoint_module(m)): recompute the unit
            if len(modules) > 1 and (checkpointed or inner is not None):
                raise ValueError(f"fully_shard([...]): {type(m).__name__} carries another library's forward or "
                                 "checkpointing; a unit of several modules takes plain modules (checkpoint with "
                                 "apply_activation_checkpointing around them, or shard them one by one)")
            mix_into(m, door, "FSDP")
        state = _build_state(modules, kwargs, param_cls, keeps_meta, ignored)
    except BaseException:
        for m, removed in entered:
            unregister(m)
            unmix(m)
            restore(m, removed)
        raise
    state.checkpointed = state.checkpointed or checkpointed
    state.inner_forward = inner
    set_policy(modules, kwargs.get("remat_policy"))  # [Note: recomputation policies]: what it saves, checkpointed
    return state


def _build_state(modules: List[nn.Module], kwargs: Dict[str, Any], param_cls: type, keeps_meta: bool,
                 ignored: frozenset):
    import weakref

    from .collective_engine import build, model_state
    from .collective_engine.precision import warn_full_precision_units_inside
    from .collective_engine.state import FSDPState
    from .forward_overrides import checkpointed_inside, guard

    module = modules[0]
    # validate everything before touching the module: a bad option leaves it as it was
    kw = resolve(kwargs)
    options = build_options(kw)
    comm = build.collectives_for(module, kw, options)
    if kw["auto_wrap_policy"] is not None:
        from .wrap import auto_wrap_children

        auto_wrap_children(module, {**kw, "collectives": comm}, XlaFullyShardedDataParallel)
    scanned = []
    if kw["scan_layers"]:  # [Note: scanning units of the collectives engine]
        from .layer_scan.collective import install as scan_install

        scanned = scan_install.find(module, comm, kw["scan_layers"])
    for m in modules:
        inside = checkpointed_inside(m, is_unit)
        if inside:
            raise ValueError(
                f"{', '.join(inside)} inside {original_class(m).__name__} recompute(s) in backward, when the "
                "unit's parameters are shards again: make each such module a unit of its own (wrap it, or "
                "auto-wrap its class) so the recomputation gathers too, or use activation_checkpointing=True")
        warn_full_precision_units_inside(m, options.mixed_precision)
        if not keeps_meta:
            build.materialize(m, kw["param_init_fn"])
    group = build.build_group(modules, comm, options, param_cls=param_cls, keep_meta=keeps_meta, ignored=ignored)
    state = FSDPState(module, group, options)
    state.modules = [weakref.ref(m) for m in modules]
    state.device_mesh = comm.placement.mesh if comm.is_single_controller else None
    for m in modules:
        register(m, state)
    if comm.is_single_controller:  # [Note: state dicts of the single controller]
        model_state.register(group)
    for m in modules:
        m.register_forward_pre_hook(guard)  # an instance forward set after wrapping is refused
        build.cast_buffers(m, options, comm.device, cast=not keeps_meta)  # FSDP2 leaves buffers alone
    if scanned:
        scan_install.install(module, scanned, kw["scan_layers"])
    if options.execute_sharding_on_init and not any(p.is_meta for p in group.shards):
        comm.sync(group.shards)
    return state


FSDP = XlaFullyShardedDataParallel


def _apply_spmd(module: nn.Module, kwargs: Dict[str, Any]) -> nn.Module:
    """engine="spmd": parameters annotated on a mesh, collectives by the compiler; a `GspmdFullyShardedDataParallel`."""
    ignored = sorted(k for k, v in kwargs.items() if k not in SPMD_KEYWORDS and v != DEFAULTS[k])
    if "checkpoint_all_but_last" in ignored:
        raise ValueError("engine='spmd' has no checkpoint_all_but_last: with activation_checkpointing=True name what "
                         "each unit saves (remat_policy), or use engine='collectives'")
    if ignored:
        raise ValueError(f"engine='spmd' does not use {', '.join(ignored)}: the XLA partitioner schedules "
                         "the collectives; drop these options or use engine='collectives'")
    from .gspmd_engine.engine import apply_spmd_fsdp

    kw = resolve(kwargs)
    spmd = {k: kw[k] for k in SPMD_KEYWORDS if k in inspect.signature(apply_spmd_fsdp).parameters}
    apply_spmd_fsdp(module, **spmd)
    mix_into(module, GspmdFullyShardedDataParallel, "FSDP")
    from .runtime.mesh import resolve_mesh

    module._fsdp_mesh = resolve_mesh(spmd["mesh"])
    return module


class GspmdFullyShardedDataParallel(XlaFullyShardedDataParallel):
    """A module sharded by the GSPMD engine: the same methods, where they mean something.

    Parameters are global tensors the partitioner splits, so there is no shard to gather, summon or reduce by hand:
    `summon_full_params`, `unshard`/`reshard` and `no_sync` do nothing (accumulated gradients are exact either way), and
    clipping is the plain `clip_grad_norm_` over the global gradients."""

    def __init__(self, module: nn.Module, **kwargs):  # noqa: D107 - already sharded in __new__
        pass

    def forward(self, *args, **kwargs):
        return super(UnitMethods, self).forward(*args, **kwargs)  # the module's own: the partitioner shards it

    def enable_activation_checkpointing(self) -> None:
        raise ValueError("checkpoint_module() after engine='spmd' wrapping: the GSPMD engine checkpoints its units "
                         "when wrapped with activation_checkpointing=True (or checkpoint_module(layer) before "
                         "wrapping); a unit it already built cannot start recomputing")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
        if groups is not None:
            raise ValueError("clip_grad_norm_(groups=...) is for one process per device; the GSPMD engine's "
                             "gradients are global tensors")
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        pass

    @contextlib.contextmanager
    def no_sync(self):
        yield

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True):
        yield

    def get_shard_metadata(self) -> dict:
        raise NotImplementedError(
            "the GSPMD engine's parameters are global tensors, not per-rank shards: save model.state_dict() "
            "as it is, or use xla_fsdp.checkpoint.save_checkpoint")

    @property
    def device_mesh(self):
        return self._fsdp_mesh

    @property
    def sharding_layout(self) -> ShardingLayout:
        raise AttributeError("the GSPMD engine has no per-rank sharding layout; see device_mesh")

    def extra_repr(self) -> str:
        return f"[xla_fsdp GSPMD engine: mesh {dict(zip(self._fsdp_mesh.axis_names, self._fsdp_mesh.mesh_shape))}]"
