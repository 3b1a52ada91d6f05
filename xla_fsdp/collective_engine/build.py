"""Building a unit of the collectives engine: its collectives and layout, its parameter group (one shard record per
parameter), its buffers.

The front door (`xla_fsdp.api`) validates the keywords and calls these in order. A child that is already a unit
(`unit_state.is_unit`) keeps its parameters and buffers.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .. import abstract
from ..memory.host import release_freed_host_memory
from ..options import FSDPOptions, ShardingLayout, ShardingStrategy
from .collectives import Collectives, XlaCollectives
from .region_collectives import SpmdCollectives
from .dist_collectives import DistCollectives
from .manual_region import DevicePlacement
from .param import FSDPParam, ParamSite
from .param_group import FSDPParamGroup
from ..class_swap import original_class
from ..unit_state import is_unit

# id(original parameter) -> (weakref to it, weakref to its unit, its name there): names a tie split across units
_consumed_params: Dict[int, Any] = {}


def _spmd_runtime() -> bool:
    try:
        import torch_xla.runtime as xr
    except ImportError:
        return False
    return xr.is_spmd()


# [Note: collectives passed down] An auto-wrapping unit hands its `Collectives` to the children it wraps, so that a
# model's units share one (and the process groups in it). But an `auto_wrapper_callable` may give a child other options
# than its parent's (say FULL_SHARD blocks under a NO_SHARD root). Reusing the parent's collectives there would shard
# and reduce the child with the parent's layout, while the child believes it has its own: unsharded blocks whose
# gradients no rank averages, and no error. So a unit takes the collectives passed down only when they were built from
# the same layout options (`_layout_key`), and builds its own otherwise. Collectives a user passes explicitly
# (`collectives=`, for tests and benchmarks) carry no key and are used as given.
_KEY_ATTR = "_xla_fsdp_layout_key"


def _layout_key(kw: Dict[str, Any], options: FSDPOptions) -> tuple:
    groups = kw["sharding_groups"]
    groups = None if groups is None else tuple(tuple(int(r) for r in g) for g in groups)
    return (options.strategy, options.collectives.pin_layout, options.collectives.all_gather_impl,
            options.collectives.reduce_scatter_stages, options.collectives.token_chain, groups,
            kw["sharding_rank"], kw["sharding_world_size"], id(kw["mesh"]) if kw["mesh"] is not None else None)


def collectives_for(module: nn.Module, kw: Dict[str, Any], options: FSDPOptions) -> Collectives:
    """A new unit's collectives: those passed down to it when they fit its options
    ([Note: collectives passed down]), else its own."""
    key = _layout_key(kw, options)
    given = kw["collectives"]
    if given is not None and getattr(given, _KEY_ATTR, key) == key:
        return given
    comm = build_collectives(module, kw, options)
    setattr(comm, _KEY_ATTR, key)
    return comm


def build_collectives(module: nn.Module, kw: Dict[str, Any], options: FSDPOptions) -> Collectives:
    """The collectives of a new unit: torch.distributed when a process group is up and the parameters are not on an
    XLA device; under torch_xla's SPMD runtime the devices of this process (single controller); else pinned-layout XLA
    collectives between processes."""
    import torch.distributed as dist

    on_xla = any(t.device.type == "xla" for t in module.parameters())
    use_dist = not on_xla and dist.is_available() and dist.is_initialized()
    if (not use_dist or kw["mesh"] is not None) and _spmd_runtime():  # a mesh means the devices of this process
        from xla_fsdp.runtime.choice import check_spmd_came_first

        check_spmd_came_first("XlaFullyShardedDataParallel")
        return _build_single_controller(kw, options)
    if kw["mesh"] is not None:
        raise ValueError("mesh= needs the SPMD runtime (call torch_xla.runtime.use_spmd() before wrapping) or "
                         "engine='spmd'; with one process per device the processes are the mesh")
    if use_dist:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        import torch_xla.runtime as xr

        rank, world = xr.global_ordinal(), xr.world_size()
    if kw["sharding_groups"] is None and options.strategy is ShardingStrategy.HYBRID_SHARD:
        from xla_fsdp.runtime.slices import slice_groups

        kw = {**kw, "sharding_groups": [list(g) for g in slice_groups(world)]}  # [Note: HSDP across slices]
    layout = _build_layout(rank, world, kw, options.strategy)
    if use_dist:
        device = next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
        return DistCollectives(layout, options.collectives, device)
    return XlaCollectives(layout, options.collectives)


def _build_single_controller(kw: Dict[str, Any], options: FSDPOptions) -> SpmdCollectives:
    """Collectives between the devices of this process ([Note: single-controller runtime])."""
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    if kw["sharding_rank"] is not None:
        raise ValueError("sharding_rank= has no meaning in the single-controller runtime (one process drives "
                         "every device); drop it and give sharding_groups as device ids")
    groups = kw["sharding_groups"]
    if options.strategy is ShardingStrategy.NO_SHARD:
        if kw["mesh"] is not None:
            raise ValueError("sharding_strategy=NO_SHARD replicates every parameter over every device; drop mesh=")
        groups = [[d] for d in range(devices)]
    elif groups is None and kw["mesh"] is None and options.strategy is ShardingStrategy.HYBRID_SHARD:
        from xla_fsdp.runtime.slices import device_slices

        groups = [list(g) for g in device_slices()]  # [Note: HSDP across slices]
    placement = DevicePlacement.build(kw["mesh"], groups, devices)
    if len(placement.shard_groups) > 1 and options.strategy not in (ShardingStrategy.HYBRID_SHARD,
                                                                    ShardingStrategy.NO_SHARD):
        raise ValueError(
            f"{len(placement.shard_groups)} sharding groups with sharding_strategy={options.strategy.value}: in the "
            "single-controller runtime the batch is split over every device, so several groups mean hybrid "
            "sharding; pass sharding_strategy='HYBRID_SHARD'. (torch_xla's meaning of sharding_groups, FSDP "
            "mixed with model parallelism, needs one process per device.)")
    # the controller speaks for the first device; the groups are what every device shares
    layout = _build_layout(placement.shard_groups[0][0], devices,
                           {**kw, "sharding_groups": placement.shard_groups}, ShardingStrategy.FULL_SHARD)
    return SpmdCollectives(layout, options.collectives, placement)


def _build_layout(rank: int, world: int, kw, strategy: ShardingStrategy) -> ShardingLayout:
    groups = kw["sharding_groups"]
    if strategy is ShardingStrategy.NO_SHARD:
        groups = [[r] for r in range(world)]
    layout = ShardingLayout.build(rank, world, groups)
    if kw["sharding_rank"] is not None and kw["sharding_rank"] != layout.shard_rank:
        raise ValueError(f"sharding_rank={kw['sharding_rank']} but this rank ({rank}) is position "
                         f"{layout.shard_rank} of its sharding group {list(layout.shard_group)}")
    if kw["sharding_world_size"] is not None and kw["sharding_world_size"] != layout.shard_world_size:
        raise ValueError(f"sharding_world_size={kw['sharding_world_size']} but the sharding group "
                         f"{list(layout.shard_group)} has {layout.shard_world_size} ranks")
    return layout


def owned_params(module: nn.Module, ignored: frozenset = frozenset()):
    """(module, name, param, fqn) for parameters not inside an already wrapped child unit, and not among `ignored`
    (ids of FSDP2's `ignored_params`)."""
    return [(m, name, p, f"{prefix}.{name}" if prefix else name) for prefix, m in _unit_modules(module)
            for name, p in m._parameters.items() if p is not None and id(p) not in ignored]


def build_group(modules, comm: Collectives, options: FSDPOptions,
                param_cls: type = nn.Parameter, keep_meta: bool = False,
                ignored: frozenset = frozenset()) -> FSDPParamGroup:
    """Shard the parameters a module (or each of a list of modules: one unit of several) owns (not those of wrapped
    children) into one group. `param_cls`: the class of the sharded parameters (FSDP2's front door gives its own);
    `keep_meta`: a meta parameter stays a (padded) meta tensor until it is given storage; `ignored`: ids of parameters
    left alone (FSDP2's `ignored_params`). Each full tensor is freed as soon as its shard takes its place; a parameter
    already sharded by another unit (a tied weight split across units) is an error."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    module = roots[0]
    by_id: Dict[int, List] = {}  # in first-seen order
    for m, name, p, fqn in (entry for root in roots for entry in owned_params(root, ignored)):
        consumed = _consumed_params.get(id(p))
        if consumed is not None and consumed[0]() is p:
            unit, pname = consumed[1](), consumed[2]
            where = next((f"{n}.{pname}" for n, mm in module.named_modules() if mm is unit and n), None)
            other = repr(where) if where else f"{original_class(unit).__name__}.{pname}"
            raise ValueError(
                f"parameter {fqn!r} of {original_class(module).__name__} is tied to {other}, which is already "
                "sharded in its own FSDP unit; tied weights must stay in one unit: wrap their common "
                "parent instead (auto-wrap policies do this for you)"
            )
        by_id.setdefault(id(p), [p, []])[1].append(ParamSite(m, name, fqn))
    params = []
    dropped = [weakref.ref(p) for p, _ in by_id.values()]
    for pid in list(by_id):
        # popped, so each full tensor is freed as soon as its shard is registered in its place
        p, sites = by_id.pop(pid)
        rec = FSDPParam(p, sites, comm, param_cls, keep_meta)
        rec.register(rec.sharded)
        _consumed_params[pid] = (weakref.ref(p), weakref.ref(module), sites[0].fqn)
        params.append(rec)
    p = None  # the last full tensor too, before its pages are handed back
    release_freed_host_memory(dropped)  # see [Note: freed host memory stays in the process]
    return FSDPParamGroup(params, comm, options)


def materialize(module: nn.Module, param_init_fn: Optional[Callable]) -> None:
    """Give a deferred or meta-device unit real storage right before it is sharded."""
    if abstract.skip_materialization(p for _, _, p, _ in owned_params(module)):
        return  # [Note: abstract tracing]
    if param_init_fn is not None:
        if any(p.is_meta for _, _, p, _ in owned_params(module)):
            param_init_fn(module)
        return
    from ..deferred.compat import is_deferred, materialize_module

    if is_deferred(module):
        materialize_module(module, check_fn=lambda m: m is module or not is_unit(m))
    elif any(p.is_meta for _, _, p, _ in owned_params(module)):
        # built under torch.device("meta"): FSDP's default, to_empty + reset_parameters()
        from ..deferred import reset_meta_modules

        reset_meta_modules(_unit_modules(module), original_class(module).__name__)
    leftover = [fqn for _, _, p, fqn in owned_params(module) if p.is_meta]
    if leftover:
        raise ValueError(
            f"{original_class(module).__name__} has parameters without storage ({', '.join(leftover[:3])}...); build it "
            "with xla_fsdp.deferred_init(...) or pass param_init_fn= to materialize each unit"
        )


def _unit_modules(module: nn.Module):
    """(name, module) for `module` and its descendants outside already wrapped child units, in definition order. An
    explicit stack, not a recursive closure: a closure that refers to itself is a reference cycle, which would keep the
    full tensors alive until the cycle collector runs."""
    out, stack = [], [("", module)]
    while stack:
        name, m = stack.pop()
        out.append((name, m))
        children = [(f"{name}.{n}" if name else n, c) for n, c in m._modules.items()
                    if c is not None and not is_unit(c)]
        stack.extend(reversed(children))  # definition order, as named_modules()
    return out


def cast_buffers(module: nn.Module, options: FSDPOptions, device, cast: bool = True) -> None:
    """Move the buffers `module` owns to `device`, cast to the buffer (or compute) dtype
    (with `cast`). Meta buffers stay meta (FSDP2's to_empty() gives them storage)."""
    mp = options.mixed_precision
    dtype = (mp.buffer_dtype or (mp.compute_dtype if mp.enabled else None)) if cast else None
    for _, m in _unit_modules(module):
        for name, b in m._buffers.items():
            if b is None or (b.is_meta and not cast and not abstract.active()):
                continue
            target = abstract.to_device(b, device)
            m._buffers[name] = target.to(dtype) if dtype is not None and b.is_floating_point() else target
