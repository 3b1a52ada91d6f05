"""The public front door: `XlaFullyShardedDataParallel` (alias `FSDP`).

It accepts torch_xla's keyword names, so switching from
`torch_xla.distributed.fsdp.XlaFullyShardedDataParallel` is an import change.

[Note: no wrapper module] Like PyTorch's FSDP2, wrapping does not put the
module inside a container: `XlaFullyShardedDataParallel(m)` returns `m` itself
with its class swapped to a subclass of both `XlaFullyShardedDataParallel` and
`type(m)`. Parameter names and state-dict keys stay those of the unwrapped
model, `isinstance(m, XlaFullyShardedDataParallel)` holds, and `m.parameters()`
yields the local shards.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch
import torch.nn as nn

from .class_swap import mix_into, original_class, unmix
from .keywords import DEFAULTS, SPMD_KEYWORDS, build_options, resolve
from .options import ShardingLayout


class XlaFullyShardedDataParallel(nn.Module):
    """Shard every parameter of `module` on dim 0 across the sharding group.

    See docs/migration.md for the keywords. Returns `module` itself (see [Note: no wrapper module]).
    """

    def __new__(cls, module: nn.Module = None, *args, **kwargs):
        if args:
            raise TypeError("XlaFullyShardedDataParallel takes the module positionally and options as keywords")
        if not isinstance(module, nn.Module):
            raise TypeError(f"XlaFullyShardedDataParallel expects an nn.Module, got {type(module).__name__}")
        unknown = sorted(set(kwargs) - set(DEFAULTS))
        if unknown:
            import difflib

            hints = [f"{k!r} (did you mean {difflib.get_close_matches(k, DEFAULTS, 1)[0]!r}?)"
                     if difflib.get_close_matches(k, DEFAULTS, 1) else repr(k) for k in unknown]
            raise TypeError(f"XlaFullyShardedDataParallel got unexpected keyword argument(s): {', '.join(hints)}")
        if isinstance(module, XlaFullyShardedDataParallel):
            raise ValueError(
                f"{type(module).__name__} is already wrapped by XlaFullyShardedDataParallel; "
                "wrap each module once (auto_wrap_policy skips wrapped children)"
            )
        if type(module).forward is nn.Module.forward:
            raise ValueError(
                f"{type(module).__name__} has no forward(), so it can never gather its parameters; "
                "wrap its children (e.g. each layer of a ModuleList) or the module that calls them"
            )
        if kwargs.get("engine", "collectives") == "spmd":
            return _apply_spmd(module, kwargs)
        from .activation_checkpoint import strip_checkpoint
        from .forward_overrides import adopt

        recompute, inner, removed = adopt(module)  # see [Note: foreign forwards]
        checkpointed = strip_checkpoint(module) or recompute  # FSDP(checkpoint_module(m)): recompute the unit
        mix_into(module, cls, "FSDP")
        module._fsdp_checkpointed = checkpointed
        module._fsdp_inner_forward = inner
        module._fsdp_removed_attrs = removed
        return module

    def __init__(self, module: nn.Module, **kwargs):  # noqa: D107 - nn.Module.__init__ must not run again
        try:
            self._fsdp_init(module, kwargs)
        except BaseException:
            from .forward_overrides import restore

            removed = module.__dict__.pop("_fsdp_removed_attrs", {})
            for name in ("_fsdp_checkpointed", "_fsdp_inner_forward"):
                module.__dict__.pop(name, None)
            unmix(module)  # nothing half-wrapped
            restore(module, removed)
            raise

    def _fsdp_init(self, module, kwargs):
        from .collective_engine import build
        from .collective_engine.state import FSDPState

        # validate everything before touching the module: a bad option leaves it as it was
        kw = resolve(kwargs)
        options = build_options(kw)
        comm = build.collectives_for(module, kw, options)
        if kw["auto_wrap_policy"] is not None:
            from .wrap import auto_wrap_children

            auto_wrap_children(module, {**kw, "collectives": comm}, XlaFullyShardedDataParallel)
        from .forward_overrides import checkpointed_inside, guard

        inside = checkpointed_inside(module, lambda m: isinstance(m, XlaFullyShardedDataParallel))
        if inside:
            raise ValueError(
                f"{', '.join(inside)} inside {original_class(module).__name__} recompute(s) in backward, when the "
                "unit's parameters are shards again: make each such module a unit of its own (wrap it, or "
                "auto-wrap its class) so the recomputation gathers too, or use activation_checkpointing=True")
        from .collective_engine.precision import warn_full_precision_units_inside

        warn_full_precision_units_inside(module, options.mixed_precision, XlaFullyShardedDataParallel)
        fsdp2 = self._fsdp_keeps_meta  # FSDP2's fully_shard: a meta module stays meta until to_empty()
        if not fsdp2:
            build.materialize(module, kw["param_init_fn"], XlaFullyShardedDataParallel)
        group = build.build_group(module, comm, options, XlaFullyShardedDataParallel,
                                  param_cls=self._fsdp_param_class, keep_meta=fsdp2)
        self._fsdp_state = FSDPState(module, group, options)
        if comm.is_single_controller:  # [Note: state dicts of the single controller]
            from .collective_engine import full_shapes

            full_shapes.register(group)
        module.register_forward_pre_hook(guard)  # an instance forward set after wrapping is refused
        module.__dict__.pop("_fsdp_removed_attrs", None)
        build.cast_buffers(module, options, comm.device, XlaFullyShardedDataParallel,
                           cast=not fsdp2)  # FSDP2's MixedPrecisionPolicy leaves buffers alone
        if options.execute_sharding_on_init and not any(p.is_meta for p in group.shards):
            comm.sync(group.shards)

    # what FSDP2's front door (xla_fsdp.fsdp) changes: the parameters' class, and meta modules
    # kept on the meta device at wrap time (to_empty() gives them storage)
    _fsdp_param_class = nn.Parameter
    _fsdp_keeps_meta = False

    # -- runtime -----------------------------------------------------------
    def forward(self, *args, **kwargs):
        run = self._fsdp_inner_forward or super().forward
        if getattr(self, "_fsdp_checkpointed", False) and not getattr(self, "_fsdp_keeps_activations", False):
            from .activation_checkpoint import checkpointed_call

            return checkpointed_call(lambda *a, **k: self._fsdp_state.forward(run, a, k), args, kwargs, self)
        return self._fsdp_state.forward(run, args, kwargs)

    def enable_activation_checkpointing(self) -> None:
        """Recompute this unit's whole forward (gather, compute, free) in backward;
        what `checkpoint_module(unit)` calls on a unit."""
        self._fsdp_checkpointed = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
        """Clip gradients of all shards of all units so their global norm is at most `max_norm`.

        `groups` (torch_xla's keyword): lists of ranks over which the norm is summed, for
        FSDP mixed with model parallelism; default the sharding group.
        """
        from .collective_engine.clip_grad import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type, groups)

    # -- full parameters ------------------------------------------------------------
    def unshard(self) -> None:
        """FSDP2's unshard(): this unit's parameters whole until `reshard()` (not its child units).
        Collective: every rank calls it. For evaluation and inspection (no gradients flow)."""
        self._fsdp_state.unshard()

    def reshard(self) -> None:
        """Back to the shards after `unshard()`."""
        self._fsdp_state.reshard()

    def _units_below(self) -> list:
        """This unit and every unit nested in it."""
        return [m for m in self.modules() if getattr(m, "_fsdp_state", None) is not None]

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, writeback: bool = True):
        """PyTorch FSDP's context with every parameter whole (of all units below, with
        `recurse`), e.g. to evaluate or generate without per-layer gathers. With `writeback`,
        in-place changes to the full parameters are kept. Collective: every rank enters it."""
        units = self._units_below() if recurse else [self]
        for unit in units:
            unit._fsdp_state.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit._fsdp_state.reshard(writeback)

    # -- gradient accumulation ---------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: with False, backward reduces nothing and each rank accumulates full
        gradients (full-size memory) until a backward with True reduces them all together.
        The XLA-friendly alternative keeps it True: each backward reduce-scatters and the shard
        gradients accumulate, 1/N the memory for a collective per micro-batch."""
        units = self._units_below() if recurse else [self]
        for unit in units:
            unit._fsdp_state.group.requires_grad_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """torch_xla's (and Accelerate's) gradient accumulation: inside, backward skips all
        communication and accumulates full gradients; the first backward after it reduces."""
        if self._fsdp_state.is_root is False:
            raise RuntimeError(f"no_sync() must be called on the root unit, not on {original_class(self).__name__}")
        units = [m._fsdp_state.group for m in self._units_below()]
        before = [g.requires_grad_sync for g in units]
        for g in units:
            g.requires_grad_sync = False
        try:
            yield
        finally:
            for g, value in zip(units, before):
                g.requires_grad_sync = value

    def get_shard_metadata(self) -> dict:
        """How this rank's `state_dict()` is sharded (torch_xla's name); saved next to it, it lets
        `xla_fsdp.consolidate_sharded_model_checkpoints` rebuild the full model."""
        from .collective_engine.shard_metadata import shard_metadata

        return shard_metadata(self)

    @property
    def module(self) -> nn.Module:
        """The module itself: torch_xla's FSDP wraps it in `.module`, here the module is the
        wrapper. A child named "module" of the user's model keeps its name."""
        child = self._modules.get("module")
        return child if child is not None else self

    @property
    def device_mesh(self):
        """The mesh the single-controller runtime shards over (None with one process per device)."""
        comm = self._fsdp_state.group.comm
        return comm.placement.mesh if comm.is_single_controller else None

    @property
    def sharding_layout(self) -> ShardingLayout:
        return self._fsdp_state.group.comm.layout

    def extra_repr(self) -> str:
        layout = self.sharding_layout
        return (f"[xla_fsdp unit: {len(self._fsdp_state.group.params)} params, "
                f"shard {layout.shard_rank}/{layout.shard_world_size}]")


FSDP = XlaFullyShardedDataParallel


def _apply_spmd(module: nn.Module, kwargs: Dict[str, Any]) -> nn.Module:
    """engine="spmd": annotate parameters on a 1-D "fsdp" mesh; the compiler inserts collectives.
    The module becomes a `GspmdFullyShardedDataParallel` (an `XlaFullyShardedDataParallel`)."""
    ignored = sorted(k for k, v in kwargs.items() if k not in SPMD_KEYWORDS and v != DEFAULTS[k])
    if "checkpoint_all_but_last" in ignored:
        raise ValueError("engine='spmd' has no checkpoint_all_but_last: with activation_checkpointing=True it "
                         "recomputes every unit; drop the option or use engine='collectives'")
    if ignored:
        raise ValueError(f"engine='spmd' does not use {', '.join(ignored)}: the XLA partitioner schedules "
                         "the collectives; drop these options or use engine='collectives'")
    from .spmd_engine.engine import apply_spmd_fsdp

    kw = resolve(kwargs)
    spmd = {k: kw[k] for k in ("mesh", "compute_dtype", "buffer_dtype", "auto_wrap_policy", "auto_wrapper_callable",
                               "param_init_fn", "activation_checkpointing")}
    mesh = spmd["mesh"]
    apply_spmd_fsdp(module, **spmd)
    mix_into(module, GspmdFullyShardedDataParallel, "FSDP")
    from .runtime.mesh import resolve_mesh

    module._fsdp_mesh = resolve_mesh(mesh)
    return module


class GspmdFullyShardedDataParallel(XlaFullyShardedDataParallel):
    """A module sharded by the GSPMD engine: the same methods, where they mean something.

    Parameters are global tensors the partitioner splits, so there is no shard to gather,
    summon or reduce by hand: `summon_full_params`, `unshard`/`reshard` and `no_sync` do
    nothing (accumulated gradients are exact either way), and clipping is the plain
    `clip_grad_norm_` over the global gradients.
    """

    def __init__(self, module: nn.Module, **kwargs):  # noqa: D107 - already sharded in __new__
        pass

    def forward(self, *args, **kwargs):
        return super(XlaFullyShardedDataParallel, self).forward(*args, **kwargs)

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

    def unshard(self) -> None:
        pass

    def reshard(self) -> None:
        pass

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
