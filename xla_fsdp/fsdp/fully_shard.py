"""`fully_shard`: PyTorch FSDP2's entry point, on the collective engine's single controller.

[Note: fully_shard on XLA] `fully_shard(module, ...)` turns `module` into an `FSDPModule` in place: its parameters not
already owned by a unit below it become one unit of the collective engine ([Note: single-controller runtime]), held as
`ShardedParameter`s ([Note: FSDP2 parameters on XLA]). Applied bottom-up (layers, then the root), the root's forward
runs every device's share of the batch inside one SPMD manual-sharding region, where each unit all-gathers just in time
and reduce-scatters its gradients, exactly as `XlaFullyShardedDataParallel(..., auto_wrap_policy=...)` would. FSDP2's
arguments map onto the engine's options (`_engine_keywords`); whatever has no meaning here is refused by name rather
than ignored."""
from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch.nn as nn

from ..deferred.tied_embeddings import retie
from .module import FSDPModule
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_mp_policy, as_offload_policy


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh=None,
                reshard_after_forward: Optional[Union[bool, int]] = None,
                shard_placement_fn: Optional[Callable] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params=None):
    """Shard `module`'s parameters on dim 0 over every device (see [Note: fully_shard on XLA]).

    Same signature and meaning as `torch.distributed.fsdp.fully_shard`; returns `module`, now an instance of
    `FSDPModule`. A list of modules becomes one unit ([Note: a unit of several modules]): their parameters are gathered
    together; each module becomes an `FSDPModule`."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        _check_module(m)
    _check_disjoint(modules)
    for m in modules:
        retie(m)  # [Note: ties lost on the way to the device]
    from ..collective_engine.sharded_param import ShardedParameter

    ignored = _ignored(modules, ignored_params)
    mp = as_mp_policy(mp_policy)
    offload = as_offload_policy(offload_policy)
    for m in modules:
        _enter_spmd(m)
    from .device_mesh import resolve_fsdp_mesh

    mesh = resolve_fsdp_mesh(mesh)
    for m in modules:
        _check_placements(m, shard_placement_fn)
    kw = _engine_keywords(mp, reshard_after_forward, int(mesh.xla.mesh_shape[-1]))
    kw["mesh"] = mesh.xla
    if mesh.replicas > 1:  # HSDP: shard within each row of the mesh, replicate across rows
        kw["sharding_strategy"] = "HYBRID_SHARD"
        kw["sharding_groups"] = mesh.shard_groups()
    kw["collectives"] = mesh.collectives  # every unit over one mesh shares one (if it fits)
    from ..api import make_unit

    state = make_unit(modules if len(modules) > 1 else modules[0], kw, FSDPModule, param_cls=ShardedParameter,
                      keeps_meta=True, ignored=ignored)
    if mesh.collectives is None:
        mesh.collectives = state.group.comm
    state.mp_policy = mp
    state.device_mesh = mesh.device_mesh
    state.unshard_feeds_forward = True  # FSDP2's unshard(): a forward under autograd still gathers
    for rec in state.group.params:
        rec.sharded.bind(rec, mesh.device_mesh)
    from ..collective_engine import model_state, optimizer_state
    from . import dcp, step_cut

    for m in modules:
        model_state.register_state_tensors(m)
        m.register_state_dict_pre_hook(step_cut.before_state_dict)
    dcp.use_host_chunks()  # several hosts: DCP writes and reads each host's rows ([Note: DCP across hosts])
    optimizer_state.install()
    step_cut.install()
    if isinstance(offload, CPUOffloadPolicy):
        from .offload import HostOffload

        state.offload = HostOffload.attach(modules[0])
    return module


def _check_module(module) -> None:
    """Refuse what cannot become (part of) a unit, naming it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(module).__name__}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(f"fully_shard does not support containers that do not implement forward: "
                         f"{type(module).__name__}; call it on each module inside, and on the module that calls them")
    name = type(module).__name__
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {name}; apply it once per module")
    from ..api import XlaFullyShardedDataParallel

    if isinstance(module, XlaFullyShardedDataParallel):
        raise ValueError(f"{name} is already wrapped by XlaFullyShardedDataParallel; use one of the two APIs")
    v1 = [n for n, m in module.named_modules() if isinstance(m, XlaFullyShardedDataParallel)]
    if v1:
        raise ValueError(f"fully_shard({name}): {v1[0]!r} inside it is wrapped by XlaFullyShardedDataParallel; "
                         "use one of the two APIs for the whole model")
    from ..collective_engine.sharded_param import ShardedParameter

    owned = [n for n, p in module.named_parameters() if isinstance(p, ShardedParameter) and not _inside_unit(module, n)]
    if owned:
        raise ValueError(f"fully_shard({name}) after its parent: {owned[0]!r} is already sharded by an enclosing "
                         "fully_shard call. Apply fully_shard bottom-up: each layer first, then the modules above, "
                         "the root last")


def _check_disjoint(modules: List[nn.Module]) -> None:
    """A list's modules must be distinct and none inside another (their parameters would belong to one unit twice)."""
    if not modules:
        raise ValueError("fully_shard([]) got no module; pass a module or a non-empty list of modules")
    for i, a in enumerate(modules):
        for j, b in enumerate(modules):
            if i != j and (a is b or any(m is b for m in a.modules())):
                what = f"item {i} again" if a is b else f"inside {type(a).__name__} (item {i})"
                raise ValueError(f"fully_shard([...]): item {j}, a {type(b).__name__}, is {what}; the modules of "
                                 "one unit must not overlap: pass the outer one alone, or disjoint modules")


def _ignored(modules: List[nn.Module], ignored_params) -> frozenset:
    """The ids of `ignored_params`, each checked to be a parameter of the modules. An ignored parameter is not sharded
    and its gradient is not reduce-scattered: it stays one replicated tensor, every device computes with the whole of
    it, and its gradient is that of the process's whole batch (the sum over its devices), as a GPU rank's is of its own
    batch."""
    if not ignored_params:
        return frozenset()
    ids = {id(p) for m in modules for p in m.parameters()}
    stray = [p for p in ignored_params if id(p) not in ids]
    if stray:
        raise ValueError(f"fully_shard(ignored_params=...): {len(stray)} of them (shape {tuple(stray[0].shape)}) "
                         f"is not a parameter of {', '.join(type(m).__name__ for m in modules)}; pass "
                         "parameters of the module(s) given")
    return frozenset(id(p) for p in ignored_params)


def _inside_unit(module: nn.Module, param_name: str) -> bool:
    """Whether `param_name` belongs to an FSDPModule strictly below `module` (a child unit)."""
    parts = param_name.split(".")[:-1]
    m = module
    for part in parts:
        m = getattr(m, part)
        if isinstance(m, FSDPModule):
            return True
    return False


def _enter_spmd(module: nn.Module) -> None:
    """fully_shard runs on the single controller: turn the SPMD runtime on if nothing stands in the way, else say what
    to do."""
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return
    from .process_group import runtime_started

    if runtime_started() and xr.world_size() > 1:
        raise RuntimeError(
            f"xla_fsdp.fsdp.fully_shard runs on the single controller (one process per host drives every chip, with "
            f"FSDP2's per-process rank semantics), and this is one of {xr.world_size()} processes of one process per "
            "chip (xmp.spawn or xla_spawn --per_chip). Launch the script with `python launch/xla_spawn.py --spmd ...` "
            "(or plain `python script.py`), or use xla_fsdp.XlaFullyShardedDataParallel, which runs one process per "
            "chip")
    if any(t.device.type == "xla" for t in list(module.parameters()) + list(module.buffers())):
        raise RuntimeError(
            "xla_fsdp.fsdp.fully_shard runs on the single controller (one process drives every chip of its host), and "
            "this model is already on an XLA device without it: call torch_xla.runtime.use_spmd() at the start of the "
            "script, before creating any XLA tensor (or launch with `python launch/xla_spawn.py --spmd ...`), and "
            "build the model on the meta device or on the CPU")
    xr.use_spmd()


def _check_placements(module: nn.Module, shard_placement_fn) -> None:
    if shard_placement_fn is None:
        return
    from torch.distributed.tensor import Shard

    for pname, p in module.named_parameters():
        placement = shard_placement_fn(p)
        if placement is None:
            continue
        dim = getattr(placement, "dim", None) if isinstance(placement, Shard) else None
        if dim is None:
            raise ValueError(f"shard_placement_fn returned {placement!r} for {pname!r}: return None or a Shard")
        if dim not in (0, -p.dim() if p.dim() else 0):
            raise ValueError(
                f"shard_placement_fn returned Shard({dim}) for {pname!r}: xla_fsdp shards every parameter on "
                "dim 0 (gathered and reduce-scattered as rows); return None or Shard(0)")


def _engine_keywords(mp: MixedPrecisionPolicy, reshard_after_forward, devices: int) -> dict:
    """FSDP2's arguments as the collective engine's keywords."""
    import torch

    if reshard_after_forward is None:
        reshard, on_root = True, False  # FSDP2: True below the root, False on it
    elif isinstance(reshard_after_forward, bool):
        reshard, on_root = reshard_after_forward, reshard_after_forward
    elif isinstance(reshard_after_forward, int):
        if reshard_after_forward == devices:
            reshard, on_root = True, True
        elif reshard_after_forward == 1:
            reshard, on_root = False, False
        else:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward}: resharding to a smaller group after forward "
                f"is not supported here (on a TPU slice every chip's gather runs over the same interconnect); "
                f"pass True ({devices}) or False (1)")
    else:
        raise TypeError(f"reshard_after_forward must be None, a bool or an int, got {reshard_after_forward!r}")
    if mp.param_dtype is not None and not mp.cast_forward_inputs:
        raise NotImplementedError(
            "MixedPrecisionPolicy(cast_forward_inputs=False) is not supported here: each unit casts its floating "
            "inputs to param_dtype; keep the default (True)")
    reduce, compute = mp.reduce_dtype, mp.param_dtype
    if compute is None and reduce not in (None, torch.float32):
        raise NotImplementedError(
            f"MixedPrecisionPolicy(reduce_dtype={reduce}) with float32 parameters: gradients are reduced in the "
            "compute dtype or in float32 here; set param_dtype too, or drop reduce_dtype")
    if compute is not None and reduce not in (None, compute, torch.float32):
        raise NotImplementedError(f"MixedPrecisionPolicy(param_dtype={compute}, reduce_dtype={reduce}): "
                                  f"gradients are reduced in param_dtype or in float32 here")
    return dict(reshard_after_forward=reshard, disable_reshard_on_root=not on_root, compute_dtype=compute,
                fp32_reduce_scatter=compute is not None and reduce == torch.float32 and compute != torch.float32)
