"""The front door's keywords: torch_xla's FSDPv1 list plus ours, what each does here, and the typed options they become.

Every keyword of torch_xla 2.9's `XlaFullyShardedDataParallel` is accepted (`tests/test_keywords.py` reads its signature
and fails on one that is not classified below). Those with no counterpart here have a documented behaviour (`NO_EFFECT`)
or are refused when set (`REFUSED`); nothing is silently ignored that would change results."""
from __future__ import annotations

from typing import Any, Dict

import torch

from .. import options as opts
from . import table as keyword_table
from ..options import FSDPOptions, ShardingStrategy
from ..runtime import environment

# every list of keywords comes from the one table (keywords/table.py)
DEFAULTS: Dict[str, Any] = keyword_table.DEFAULTS
# torch_xla keywords accepted with no effect, and why (docs/migration.md, "Keyword by keyword")
NO_EFFECT: Dict[str, str] = keyword_table.NO_EFFECT
# torch_xla debugging switches: refused when set
REFUSED = keyword_table.REFUSED_WHEN_SET
# what engine="spmd" takes; anything else set to a non-default value is an error there
SPMD_KEYWORDS = keyword_table.GSPMD
ENGINES = ("collectives", "spmd")


def resolve(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Defaults filled in, torch_xla's spellings mapped onto ours, contradictions refused."""
    kw = {**DEFAULTS, **kwargs}
    if kw["engine"] not in ENGINES:
        raise ValueError(f"engine={kw['engine']!r} is not valid; use one of {ENGINES}")
    for name in REFUSED:
        if kw[name] != DEFAULTS[name]:
            raise ValueError(f"{name} is a debugging switch of torch_xla's FSDP that xla_fsdp does not have; drop it")
    if not isinstance(kw["shard_param_on_dim_0"], bool):
        # torch_xla tests its truth; a string such as "false" would then mean True
        raise TypeError(f"shard_param_on_dim_0={kw['shard_param_on_dim_0']!r} is not a bool; pass True or False "
                        "(here both shard on dim 0) or drop the option")
    if not (isinstance(kw["scan_layers"], bool) or kw["scan_layers"] == "per_step"):
        raise TypeError(f"scan_layers={kw['scan_layers']!r} is not valid; pass True (parameters stored "
                        "stacked), \"per_step\" (per-layer parameters, stacked every step) or False")
    if kw["scan_layers"] and kw["engine"] != "spmd" and kw["auto_wrap_policy"] is None:
        raise ValueError(f"scan_layers={kw['scan_layers']!r} scans the repeated layer the auto_wrap_policy wraps; pass an "
                         "auto_wrap_policy that wraps it (e.g. transformer_auto_wrap_policy of your layer class)")
    if kw["remat_policy"] is not None:  # [Note: recomputation policies]
        from ..memory.remat_policy import policy_named

        kw["remat_policy"] = policy_named(kw["remat_policy"]).name
        if kw["remat_policy"] == "fit" and kw["engine"] == "spmd":
            raise ValueError("remat_policy=\"fit\" chooses each unit's policy from the chip's memory on the collectives "
                             "engine only; name a policy for engine='spmd' (e.g. \"save_dot_except_mlp\")")
        if not kw["activation_checkpointing"] and kw["auto_wrapper_callable"] is None and kw["engine"] == "spmd":
            raise ValueError(f"remat_policy={kw['remat_policy']!r} says what checkpointed units save, and none is "
                             "checkpointed: pass activation_checkpointing=True too")
    if kw["coalesce_all_gather_ops"]:
        # torch_xla: one coalesced all-gather for a unit's parameters; here, one flat bucket
        if kw["flatten_parameters"] is False:
            raise ValueError("coalesce_all_gather_ops=True asks for one collective per unit and flatten_parameters=False "
                             "for one per parameter; drop one of the two")
        kw["flatten_parameters"] = True
    if kw["mixed_precision"] is not None:
        _apply_mixed_precision(kw)
    return kw


def _apply_mixed_precision(kw: Dict[str, Any]) -> None:
    """`mixed_precision=` as our MixedPrecision or torch's (param_dtype, reduce_dtype, buffer_dtype)."""
    policy = kw["mixed_precision"]
    given = [k for k in ("compute_dtype", "buffer_dtype", "fp32_reduce_scatter") if kw[k] != DEFAULTS[k]]
    if given:
        raise ValueError(f"mixed_precision= and {', '.join(given)} both set the dtypes; give one of them")
    if isinstance(policy, opts.MixedPrecision):
        kw.update(compute_dtype=policy.compute_dtype, buffer_dtype=policy.buffer_dtype,
                  fp32_reduce_scatter=policy.fp32_reduce_scatter)
        return
    if all(hasattr(policy, a) for a in ("param_dtype", "reduce_dtype", "buffer_dtype")):  # torch FSDP's
        compute = policy.param_dtype or torch.float32
        reduce = policy.reduce_dtype or compute
        if reduce not in (compute, torch.float32):
            raise ValueError(f"mixed_precision.reduce_dtype={reduce} with param_dtype={compute}: xla_fsdp reduces "
                             "in the compute dtype or in float32 (fp32_reduce_scatter)")
        kw.update(compute_dtype=compute, buffer_dtype=policy.buffer_dtype,
                  fp32_reduce_scatter=reduce == torch.float32 and compute != torch.float32)
        return
    raise TypeError(f"mixed_precision must be xla_fsdp.MixedPrecision or torch.distributed.fsdp.MixedPrecision, "
                    f"got {type(policy).__name__}")


def build_options(kw: Dict[str, Any]) -> FSDPOptions:
    """The typed policy objects the engine reads (`kw` as `resolve` returns it)."""
    strategy = ShardingStrategy.parse(kw["sharding_strategy"])
    if (strategy is ShardingStrategy.HYBRID_SHARD and kw["sharding_groups"] is None and kw["mesh"] is None
            and environment.num_slices() == 1):  # on several slices the slices are the groups
        raise ValueError("sharding_strategy=HYBRID_SHARD needs sharding_groups=[[ranks of group 0], ...] (on a "
                         "multislice job the slices are the groups)")
    if strategy is ShardingStrategy.NO_SHARD and kw["sharding_groups"] is not None:
        raise ValueError("sharding_strategy=NO_SHARD replicates everything; drop sharding_groups")
    reshard = kw["reshard_after_forward"] and strategy not in (ShardingStrategy.SHARD_GRAD_OP,
                                                               ShardingStrategy.NO_SHARD)
    if (environment.num_slices() > 1 and kw["sharding_groups"] is None and kw["mesh"] is None
            and strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)):
        strategy = ShardingStrategy.HYBRID_SHARD  # [Note: HSDP across slices]: the slices are the groups (build.py)
    mixed_precision = opts.MixedPrecision(compute_dtype=kw["compute_dtype"] or torch.float32,
                                          buffer_dtype=kw["buffer_dtype"],
                                          fp32_reduce_scatter=bool(kw["fp32_reduce_scatter"]))
    collectives = opts.CollectiveOptions(
        pin_layout=bool(kw["pin_layout_in_collective_ops"]), all_gather_impl=kw["all_gather_impl"],
        flatten_parameters=None if kw["flatten_parameters"] is None else bool(kw["flatten_parameters"]),
        reduce_scatter_bucket_size_mb=float(kw["reduce_scatter_bucket_size_mb"] or 0),
        reduce_scatter_stages=str(kw["reduce_scatter_stages"]), token_chain=str(kw["token_chain"]),
        optimization_barrier_in_forward=bool(kw["optimization_barrier_in_forward"]),
        optimization_barrier_in_backward=bool(kw["optimization_barrier_in_backward"]))
    return FSDPOptions(strategy=strategy, mixed_precision=mixed_precision, collectives=collectives,
                       reshard=opts.ReshardPolicy(bool(reshard), bool(kw["disable_reshard_on_root"])),
                       sync_on_finalization=bool(kw["sync_on_finalization"]),
                       execute_sharding_on_init=bool(kw["execute_sharding_on_init"]),
                       is_batched_input=kw["is_batched_input"],
                       prefetch=opts.PrefetchPolicy.parse(kw["forward_prefetch"], kw["backward_prefetch"]),
                       checkpoint_all_but_last=kw["checkpoint_all_but_last"])
