"""The one table of the front door's keywords: each keyword's default, whose it is, the doors that take it, and what it
does here. Every list of keywords elsewhere is read off it: the front door's defaults and checks (resolve.py), what the
GSPMD engine acts on, the fsdp_config's `xla_fsdp_settings` keys and the ones `xla_fsdp_v2` takes (config/schema.py);
tests/test_keywords.py holds torch_xla's signature and docs/migration.md's tables to it.

It imports nothing, so that the config package, whose module-level imports stay inside it (tests/test_layout.py), reads
it without loading torch or an engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

TORCH_XLA = "torch_xla"  # a keyword of torch_xla 2.9's XlaFullyShardedDataParallel
OURS = "ours"
REFUSED = "refused when set"


@dataclass(frozen=True)
class Keyword:
    name: str
    default: Any
    origin: str  # TORCH_XLA or OURS
    json: bool = False  # an `xla_fsdp_settings` key of the fsdp_config
    gspmd: bool = False  # taken by engine="spmd" (the rest, set, are refused there)
    effect: str = ""  # "": it acts; REFUSED; else "no effect: why"


def _t(name, default, **kw) -> Keyword:
    return Keyword(name, default, TORCH_XLA, **kw)


def _o(name, default, **kw) -> Keyword:
    return Keyword(name, default, OURS, **kw)


KEYWORDS: Tuple[Keyword, ...] = (
    _t("reshard_after_forward", True, json=True),
    _t("flatten_parameters", None, json=True),  # torch_xla's default is False: docs/migration.md
    _t("execute_sharding_on_init", True, json=True),
    _t("optimization_barrier_in_forward", True, json=True),
    _t("optimization_barrier_in_backward", True, json=True),
    _t("sync_on_finalization", False, json=True),
    _t("disable_reshard_on_root", True, json=True),
    _t("compute_dtype", None, json=True, gspmd=True),
    _t("buffer_dtype", None, json=True, gspmd=True),
    _t("fp32_reduce_scatter", False, json=True),
    _t("sharding_groups", None, json=True),
    _t("sharding_rank", None, json=True),
    _t("sharding_world_size", None, json=True),
    # torch_xla's False flattens each parameter before sharding it; the consolidated model is the same either way, which
    # is all its users see (torch_xla_files.py reads torch_xla's files of both kinds)
    _t("shard_param_on_dim_0", False, json=True, gspmd=True,
       effect="no effect: parameters are always sharded on dim 0 here, unflattened"),
    _t("pin_layout_in_collective_ops", True, json=True),
    _t("reduce_scatter_bucket_size_mb", 0, json=True),
    _t("coalesce_all_gather_ops", False),
    _t("auto_wrap_policy", None, gspmd=True),
    _t("auto_wrapper_callable", None, gspmd=True),
    _t("param_init_fn", None, gspmd=True),
    _t("_shard_size_multiple", 128, gspmd=True,
       effect="no effect: shards are padded to the sharding group's size on dim 0 only"),
    _t("_use_xla_patched_linear", True, gspmd=True,
       effect="no effect: the engine's saved-tensor hooks already keep nn.Linear's backward from holding "
              "gathered weights, the problem torch_xla's patch solves"),
    _t("_debug_dummy_forward_pass", False, effect=REFUSED),
    _t("_debug_msg", "xla_fsdp", gspmd=True,
       effect="no effect: a label for torch_xla's debug prints, which xla_fsdp does not have"),
    _t("_debug_print", False, effect=REFUSED),
    _t("_debug_dummy_all_gather_op", False, effect=REFUSED),
    _t("_debug_dummy_all_reduce_op", False, effect=REFUSED),
    _t("_debug_dummy_reduce_scatter_op", False, effect=REFUSED),
    _t("_debug_dummy_optimization_barrier_op", False, effect=REFUSED),
    # ours (PyTorch FSDP's names for the first three)
    _o("mixed_precision", None, gspmd=True),
    _o("forward_prefetch", True),
    _o("backward_prefetch", "BACKWARD_PRE"),
    _o("all_gather_impl", "auto", json=True),
    _o("reduce_scatter_stages", "auto", json=True),
    _o("token_chain", "all", json=True),
    _o("sharding_strategy", "FULL_SHARD", json=True),
    _o("engine", "collectives", gspmd=True),
    _o("mesh", None, gspmd=True),
    _o("activation_checkpointing", False, gspmd=True),
    _o("checkpoint_all_but_last", 0, json=True),
    _o("remat_policy", None, json=True, gspmd=True),
    _o("scan_layers", False, gspmd=True),
    _o("is_batched_input", None),
    _o("collectives", None),
)

BY_NAME: Dict[str, Keyword] = {k.name: k for k in KEYWORDS}
DEFAULTS: Dict[str, Any] = {k.name: k.default for k in KEYWORDS}
NO_EFFECT: Dict[str, str] = {k.name: k.effect.removeprefix("no effect: ") for k in KEYWORDS
                             if k.effect.startswith("no effect")}
REFUSED_WHEN_SET: Tuple[str, ...] = tuple(k.name for k in KEYWORDS if k.effect == REFUSED)
GSPMD: Tuple[str, ...] = tuple(k.name for k in KEYWORDS if k.gspmd)
JSON: Tuple[str, ...] = tuple(k.name for k in KEYWORDS if k.json)
# the `xla_fsdp_settings` keys the GSPMD engine (`xla_fsdp_v2`) acts on; the others schedule explicit collectives, which
# the XLA partitioner inserts itself there
JSON_GSPMD: Tuple[str, ...] = tuple(k.name for k in KEYWORDS if k.json and k.gspmd and not k.effect)
