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

from . import options as opts
from .class_swap import mix_into, unmix
from .options import FSDPOptions, ShardingLayout, ShardingStrategy

# torch_xla's keywords and their defaults, plus ours (`all_gather_impl`,
# `sharding_strategy`, `engine`, `mesh`)
DEFAULTS: Dict[str, Any] = dict(
    reshard_after_forward=True,
    flatten_parameters=None,
    execute_sharding_on_init=True,
    optimization_barrier_in_forward=True,
    optimization_barrier_in_backward=True,
    sync_on_finalization=False,
    disable_reshard_on_root=True,
    compute_dtype=None,
    buffer_dtype=None,
    fp32_reduce_scatter=False,
    sharding_groups=None,
    sharding_rank=None,
    sharding_world_size=None,
    shard_param_on_dim_0=True,
    pin_layout_in_collective_ops=True,
    reduce_scatter_bucket_size_mb=0,
    auto_wrap_policy=None,
    auto_wrapper_callable=None,
    param_init_fn=None,
    all_gather_impl="all_gather",
    sharding_strategy="FULL_SHARD",
    engine="collectives",
    mesh=None,
    activation_checkpointing=False,
    is_batched_input=None,
    collectives=None,
)
# what engine="spmd" acts on; anything else set to a non-default value is an error there
SPMD_KEYWORDS = ("compute_dtype", "buffer_dtype", "auto_wrap_policy", "auto_wrapper_callable",
                 "param_init_fn", "mesh", "activation_checkpointing", "engine")
ENGINES = ("collectives", "spmd")

class XlaFullyShardedDataParallel(nn.Module):
    """Shard every parameter of `module` on dim 0 across the sharding group.

    See README for the keywords. Returns `module` itself (see [Note: no wrapper module]).
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

        kw = {**DEFAULTS, **kwargs}
        if kw["engine"] not in ENGINES:
            raise ValueError(f"engine={kw['engine']!r} is not valid; use one of {ENGINES}")
        if not kw["shard_param_on_dim_0"]:
            raise ValueError("shard_param_on_dim_0=False is not supported: xla_fsdp always shards on dim 0 "
                             "(drop the option or set it to True)")

        # validate everything before touching the module: a bad option leaves it as it was
        options = _build_options(kw)
        comm = kw["collectives"] or build.build_collectives(module, kw, options)
        if kw["auto_wrap_policy"] is not None:
            from .wrap import auto_wrap_children

            auto_wrap_children(module, {**kw, "collectives": comm}, XlaFullyShardedDataParallel)
        from .forward_overrides import checkpointed_inside, guard

        inside = checkpointed_inside(module, lambda m: isinstance(m, XlaFullyShardedDataParallel))
        if inside:
            raise ValueError(
                f"{', '.join(inside)} inside {type(module).__mro__[2].__name__} recompute(s) in backward, when the "
                "unit's parameters are shards again: make each such module a unit of its own (wrap it, or "
                "auto-wrap its class) so the recomputation gathers too, or use activation_checkpointing=True")
        build.materialize(module, kw["param_init_fn"], XlaFullyShardedDataParallel)
        group = build.build_group(module, comm, options, XlaFullyShardedDataParallel)
        self._fsdp_state = FSDPState(module, group, options)
        module.register_forward_pre_hook(guard)  # an instance forward set after wrapping is refused
        module.__dict__.pop("_fsdp_removed_attrs", None)
        build.cast_buffers(module, options, comm.device, XlaFullyShardedDataParallel)
        if options.execute_sharding_on_init:
            comm.sync(group.shards)

    # -- runtime -----------------------------------------------------------
    def forward(self, *args, **kwargs):
        run = self._fsdp_inner_forward or super().forward
        if getattr(self, "_fsdp_checkpointed", False):
            from .activation_checkpoint import checkpointed_call

            return checkpointed_call(lambda *a, **k: self._fsdp_state.forward(run, a, k), args, kwargs,
                                     self._fsdp_state.group.comm)
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

    # -- gradient accumulation ---------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: with False, backward reduces nothing and each rank accumulates full
        gradients (full-size memory) until a backward with True reduces them all together.
        The XLA-friendly alternative keeps it True: each backward reduce-scatters and the shard
        gradients accumulate, 1/N the memory for a collective per micro-batch."""
        units = [m for m in self.modules() if getattr(m, "_fsdp_state", None) is not None] if recurse else [self]
        for unit in units:
            unit._fsdp_state.group.requires_grad_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """torch_xla's (and Accelerate's) gradient accumulation: inside, backward skips all
        communication and accumulates full gradients; the first backward after it reduces."""
        if self._fsdp_state.is_root is False:
            raise RuntimeError(f"no_sync() must be called on the root unit, not on {type(self).__mro__[2].__name__}")
        units = [m._fsdp_state.group for m in self.modules() if getattr(m, "_fsdp_state", None) is not None]
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
    """engine="spmd": annotate parameters on a 1-D "fsdp" mesh; the compiler inserts collectives."""
    ignored = sorted(k for k, v in kwargs.items() if k not in SPMD_KEYWORDS and v != DEFAULTS[k])
    if ignored:
        raise ValueError(f"engine='spmd' does not use {', '.join(ignored)}: the XLA partitioner schedules "
                         "the collectives; drop these options or use engine='collectives'")
    from .spmd_engine.engine import apply_spmd_fsdp

    return apply_spmd_fsdp(module, **{k: v for k, v in kwargs.items() if k != "engine"})


def _build_options(kw) -> FSDPOptions:
    strategy = ShardingStrategy.parse(kw["sharding_strategy"])
    if strategy is ShardingStrategy.HYBRID_SHARD and kw["sharding_groups"] is None:
        raise ValueError("sharding_strategy=HYBRID_SHARD needs sharding_groups=[[ranks of group 0], ...]")
    if strategy is ShardingStrategy.NO_SHARD and kw["sharding_groups"] is not None:
        raise ValueError("sharding_strategy=NO_SHARD replicates everything; drop sharding_groups")
    reshard = kw["reshard_after_forward"] and strategy not in (ShardingStrategy.SHARD_GRAD_OP,
                                                               ShardingStrategy.NO_SHARD)
    return FSDPOptions(
        strategy=strategy,
        mixed_precision=opts.MixedPrecision(
            compute_dtype=kw["compute_dtype"] or torch.float32,
            buffer_dtype=kw["buffer_dtype"],
            fp32_reduce_scatter=bool(kw["fp32_reduce_scatter"]),
        ),
        collectives=opts.CollectiveOptions(
            pin_layout=bool(kw["pin_layout_in_collective_ops"]),
            all_gather_impl=kw["all_gather_impl"],
            flatten_parameters=None if kw["flatten_parameters"] is None else bool(kw["flatten_parameters"]),
            reduce_scatter_bucket_size_mb=float(kw["reduce_scatter_bucket_size_mb"] or 0),
            optimization_barrier_in_forward=bool(kw["optimization_barrier_in_forward"]),
            optimization_barrier_in_backward=bool(kw["optimization_barrier_in_backward"]),
        ),
        reshard=opts.ReshardPolicy(bool(reshard), bool(kw["disable_reshard_on_root"])),
        sync_on_finalization=bool(kw["sync_on_finalization"]),
        execute_sharding_on_init=bool(kw["execute_sharding_on_init"]),
        is_batched_input=kw["is_batched_input"],
    )
