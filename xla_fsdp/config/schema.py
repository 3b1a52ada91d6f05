"""The `fsdp_config` key schema: which keys exist and the checks on their values.

Owns the key lists (engine keywords, top-level keys and their aliases, keys only the torch-FSDP path reads), the dtype
tables, `FSDPConfigError`, the small validators every check uses, and `XlaFSDPSettings` (the `xla_fsdp_settings` dict).
Reading a file and checking keys against each other is `fsdp_config.py`. Imports nothing from the engines."""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from xla_fsdp.keywords import table as keyword_table

# The keyword arguments of `xla_fsdp.XlaFullyShardedDataParallel` that a JSON file can express: `xla_fsdp_settings`
# accepts exactly these. Both lists come from the front door's one keyword table (xla_fsdp/keywords/table.py, which
# imports nothing, so config reads it at load).
ENGINE_KEYWORDS: tuple[str, ...] = keyword_table.JSON

# The settings the SPMD engine (`xla_fsdp_v2`) acts on. The others schedule explicit collectives, which under SPMD the
# XLA partitioner inserts itself, so giving them with xla_fsdp_v2 would be silently ignored: they are refused.
SPMD_ENGINE_KEYWORDS: tuple[str, ...] = keyword_table.JSON_GSPMD

# Engine keywords that take Python callables, which JSON cannot carry. Naming the JSON key that replaces each is kinder
# than "unknown key".
_CALLABLE_KEYWORDS: dict[str, str] = {
    "auto_wrap_policy": "use the top-level key fsdp_transformer_layer_cls_to_wrap (a list of layer class names) or "
                        "fsdp_min_num_params (an int) instead",
    "auto_wrapper_callable": "set the top-level key xla_fsdp_grad_ckpt to true for per-layer gradient checkpointing "
                             "instead",
    "param_init_fn": "deferred initialization is set up by the training job, not the JSON; remove it (see "
                     "xla_fsdp.deferred_init)",
}

# torch_xla constructor keywords that this engine does not take; users copying settings from torch_xla examples deserve
# a precise reason.
_TORCH_XLA_ONLY_KEYWORDS: dict[str, str] = {
    "coalesce_all_gather_ops": "is a torch_xla keyword that xla_fsdp does not take; remove it (all_gather_impl "
                               "chooses how parameters are gathered)",
}

# Canonical dtype names and the spellings accepted for each.
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES: dict[str, str] = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                                  "float16": "float16", "fp16": "float16"}
_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")

# Top-level keys. Newer Hugging Face versions strip the "fsdp_" prefix before reading the dict, so both spellings reach
# us in the wild.
_TOP_LEVEL_KEYS = ("xla", "xla_fsdp_settings", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
                   "xla_fsdp_grad_ckpt", "xla_fsdp_v2", "scan_layers", "fsdp_forward_prefetch", "fsdp_backward_prefetch")
_TOP_LEVEL_ALIASES: dict[str, str] = {
    "transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "min_num_params": "fsdp_min_num_params",
    "forward_prefetch": "fsdp_forward_prefetch",
    "backward_prefetch": "fsdp_backward_prefetch",
}
# Hugging Face's (and accelerate's) spellings of `backward_prefetch`, case-insensitive; NO_PREFETCH is the engine's
# None.
BACKWARD_PREFETCH_CHOICES = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")

# Keys that only Hugging Face's torch-FSDP path (xla false) reads. Accepting them would let a user believe they had an
# effect on XLA FSDP.
_TORCH_FSDP_ONLY_HINT = ("it is read only by Hugging Face's torch FSDP path, which XLA FSDP does not use; remove it "
                         "(engine options go in xla_fsdp_settings)")
_TORCH_FSDP_ONLY_KEYS: dict[str, str] = {
    **{key: _TORCH_FSDP_ONLY_HINT for key in (
        "version", "cpu_offload", "offload_params", "limit_all_gathers", "use_orig_params", "sync_module_states",
        "cpu_ram_efficient_loading", "state_dict_type",
    )},
    "activation_checkpointing": "use xla_fsdp_grad_ckpt for per-layer gradient checkpointing",
    "reshard_after_forward": "move it into xla_fsdp_settings",
    "auto_wrap_policy": "the policy follows from fsdp_transformer_layer_cls_to_wrap or fsdp_min_num_params; remove it",
}


class FSDPConfigError(ValueError):
    """An `fsdp_config` that cannot be honoured as written; the message names the key and the fix."""


def _suggest(key: str, valid: "tuple[str, ...] | list[str]") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    listing = "valid keys: " + ", ".join(valid)
    return f"did you mean {close[0]!r}? ({listing})" if close else listing


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_bool(key: str, value: Any) -> None:
    # bool is checked by exact type: JSON 0/1 or "true" would be ambiguous.
    if type(value) is not bool:
        raise FSDPConfigError(f"{key} must be a bool (true/false), got {_type_name(value)} {value!r}")


def _check_int(key: str, value: Any, minimum: int) -> None:
    # bool is a subclass of int; `true` as a size or rank is a mistake.
    if type(value) is not int:
        raise FSDPConfigError(f"{key} must be an int, got {_type_name(value)} {value!r}")
    if value < minimum:
        raise FSDPConfigError(f"{key} must be >= {minimum}, got {value}")


def _canonical_dtype(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise FSDPConfigError(f"{key} must be a dtype name string such as \"bfloat16\", got {_type_name(value)} "
                              f"{value!r}")
    name = _DTYPE_ALIASES.get(value.lower())
    if name is None:
        raise FSDPConfigError(f"{key}: unknown dtype {value!r}; valid: " + ", ".join(_DTYPE_ALIASES))
    return name


def _canonical_choice(key: str, value: Any, choices: tuple[str, ...], upper: bool) -> str:
    if not isinstance(value, str):
        raise FSDPConfigError(f"{key} must be a string, one of {', '.join(choices)}; got {_type_name(value)} {value!r}")
    # Sharding strategies are written lowercase in `--fsdp full_shard`; accept both cases.
    normalized = value.upper() if upper else value
    if normalized not in choices:
        raise FSDPConfigError(f"{key}: unknown value {value!r}; valid: {', '.join(choices)}")
    return normalized


_BOOL_SETTINGS = ("reshard_after_forward", "flatten_parameters", "execute_sharding_on_init",
                  "optimization_barrier_in_forward", "optimization_barrier_in_backward", "sync_on_finalization",
                  "disable_reshard_on_root", "fp32_reduce_scatter", "shard_param_on_dim_0", "pin_layout_in_collective_ops")


@dataclasses.dataclass(frozen=True)
class XlaFSDPSettings:
    """The `xla_fsdp_settings` dict: engine keyword arguments as JSON values.

    Every field defaults to None, meaning "not given: use the engine's default"; only given fields reach the engine, so
    this file never restates (and can never contradict) the engine's defaults."""

    reshard_after_forward: Optional[bool] = None
    """Free gathered parameters after forward (FULL_SHARD) instead of keeping them to backward."""
    flatten_parameters: Optional[bool] = None
    """Flatten each unit's parameters into one buffer before sharding."""
    execute_sharding_on_init: Optional[bool] = None
    """Run the sharding computation at construction rather than lazily at the first step."""
    optimization_barrier_in_forward: Optional[bool] = None
    """Fence forward all-gathers so XLA cannot hoist or merge them (bounds peak memory)."""
    optimization_barrier_in_backward: Optional[bool] = None
    """Same fence for the backward pass."""
    sync_on_finalization: Optional[bool] = None
    """Synchronize (mark step) once at the end of backward."""
    disable_reshard_on_root: Optional[bool] = None
    """Keep the root unit gathered between forward and backward (it is needed again at once)."""
    compute_dtype: Optional[str] = None
    """Dtype of gathered parameters in forward/backward; canonical name (float32/bfloat16/float16)."""
    buffer_dtype: Optional[str] = None
    """Dtype of module buffers; canonical name."""
    fp32_reduce_scatter: Optional[bool] = None
    """Reduce gradients in float32 even when compute is in lower precision."""
    sharding_groups: Optional[tuple[tuple[int, ...], ...]] = None
    """Groups of global ranks that shard among themselves; needs sharding_rank and sharding_world_size."""
    sharding_rank: Optional[int] = None
    """This process's rank inside its sharding group."""
    sharding_world_size: Optional[int] = None
    """Size of each sharding group."""
    shard_param_on_dim_0: Optional[bool] = None
    """torch_xla's choice between flattened and dim-0 shards; no effect here (always dim 0)."""
    pin_layout_in_collective_ops: Optional[bool] = None
    """Pin tensor layouts in collectives so all ranks compile identical programs."""
    reduce_scatter_bucket_size_mb: Optional[int] = None
    """Bucket gradients up to this many MiB per reduce-scatter; 0 disables bucketing."""
    all_gather_impl: Optional[str] = None
    """How parameters are gathered: "auto" (rings for the single controller on a TPU, else "all_gather"), "all_gather",
    "all_reduce" (of zero-padded shards) or "ring"."""
    reduce_scatter_stages: Optional[str] = None
    """Single controller: "auto" (rings with the gathers' rings, else "axes"), "axes" (one reduce-scatter per torus axis
    on v4/v5p slices), "flat", or "ring" (rings of neighbour exchanges, which libtpu runs asynchronously)."""
    token_chain: Optional[str] = None
    """"all", "gathers" or "off": which collectives wait on torch_xla's token ([Note: collectives off the chain])."""
    sharding_strategy: Optional[str] = None
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD (case-insensitive; stored upper case)."""
    checkpoint_all_but_last: Optional[Union[int, str]] = None
    """With xla_fsdp_grad_ckpt: the last this many checkpointed layers keep their activations instead of recomputing
    them (faster, more HBM); 0 recomputes every one; "fit" keeps as many as the chip's HBM holds, measured in the first
    step."""
    remat_policy: Optional[str] = None
    """With xla_fsdp_grad_ckpt: what each checkpointed layer saves for its backward ("full", "save_qkv_proj",
    "save_out_proj", "save_dot_except_mlp", "minimal", "none" and the offloaded "full_offloaded", "qkv_proj_offloaded",
    "minimal_offloaded"; [Note: recomputation policies])."""

    def __post_init__(self) -> None:
        where = "xla_fsdp_settings."
        for name in _BOOL_SETTINGS:
            value = getattr(self, name)
            if value is not None:
                _check_bool(where + name, value)
        for name in ("compute_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _canonical_dtype(where + name, value))
        # the choice lists live with the typed options; imported here so that loading a config stays free of package
        # imports (tests/test_layout.py)
        from ..options import ALL_GATHER_IMPLS, REDUCE_SCATTER_STAGES, TOKEN_CHAINS

        choices = {"all_gather_impl": ALL_GATHER_IMPLS, "reduce_scatter_stages": REDUCE_SCATTER_STAGES,
                   "token_chain": TOKEN_CHAINS, "sharding_strategy": _SHARDING_STRATEGIES}
        for name, names in choices.items():
            if getattr(self, name) is not None:  # strategies in upper case, as `--fsdp full_shard` spells them lower
                object.__setattr__(self, name, _canonical_choice(where + name, getattr(self, name), names,
                                                                 upper=name == "sharding_strategy"))
        if self.reduce_scatter_bucket_size_mb is not None:
            _check_int(where + "reduce_scatter_bucket_size_mb", self.reduce_scatter_bucket_size_mb, 0)
        if isinstance(self.checkpoint_all_but_last, str):
            if self.checkpoint_all_but_last.lower() != "fit":
                raise FSDPConfigError(f"{where}checkpoint_all_but_last: unknown value "
                                      f"{self.checkpoint_all_but_last!r}; give an int >= 0 or \"fit\"")
            object.__setattr__(self, "checkpoint_all_but_last", "fit")
        elif self.checkpoint_all_but_last is not None:
            _check_int(where + "checkpoint_all_but_last", self.checkpoint_all_but_last, 0)
        if self.remat_policy is not None:
            from ..memory.remat_policy import NAMES

            _canonical_choice(where + "remat_policy", self.remat_policy, NAMES, upper=False)
        self._check_sharding_groups(where)
        self._check_strategy_against_reshard(where)

    def _check_sharding_groups(self, where: str) -> None:
        # One JSON file is read by every process, so sharding_groups (the same for all) is the useful key; the engine
        # derives each process's position from it and treats sharding_rank/sharding_world_size as assertions. Only what
        # can be checked without knowing the rank is checked here.
        if self.sharding_world_size is not None:
            _check_int(where + "sharding_world_size", self.sharding_world_size, 1)
        if self.sharding_rank is not None:
            _check_int(where + "sharding_rank", self.sharding_rank, 0)
            if self.sharding_world_size is not None and self.sharding_rank >= self.sharding_world_size:
                raise FSDPConfigError(f"{where}sharding_rank {self.sharding_rank} is out of range for "
                                      f"sharding_world_size {self.sharding_world_size}")
        strategy = self.sharding_strategy
        groups = self.sharding_groups
        if groups is None:
            from xla_fsdp.runtime.environment import num_slices

            if strategy == "HYBRID_SHARD" and num_slices() == 1:  # on several slices, the slices are the groups
                raise FSDPConfigError(f"{where}sharding_strategy HYBRID_SHARD needs {where}sharding_groups, e.g. "
                                      "[[0, 1, 2, 3], [4, 5, 6, 7]] (shard inside each group, replicate across)")
            return
        if strategy == "NO_SHARD":
            raise FSDPConfigError(f"{where}sharding_strategy NO_SHARD replicates every parameter, so "
                                  f"{where}sharding_groups has no effect; remove one of the two")
        if not isinstance(groups, (list, tuple)) or not groups or not all(
                isinstance(g, (list, tuple)) and g and all(type(r) is int and r >= 0 for r in g) for g in groups):
            raise FSDPConfigError(f"{where}sharding_groups must be a non-empty list of non-empty lists of non-negative "
                                  f"int ranks, e.g. [[0, 1], [2, 3]]; got {groups!r}")
        size = self.sharding_world_size if self.sharding_world_size is not None else len(groups[0])
        for group in groups:
            # Groups shard the same parameters, so they must cut them into the same number of pieces.
            if len(group) != size:
                raise FSDPConfigError(f"{where}sharding_groups: group {list(group)} has {len(group)} ranks but "
                                      + (f"sharding_world_size is {size}" if self.sharding_world_size is not None
                                         else f"group {list(groups[0])} has {size}; all groups must be the same size"))
        ranks = [r for g in groups for r in g]
        if len(ranks) != len(set(ranks)):
            raise FSDPConfigError(f"{where}sharding_groups: a rank appears more than once: {groups!r}")
        # Frozen: store tuples, not the caller's (mutable) lists.
        object.__setattr__(self, "sharding_groups", tuple(tuple(g) for g in groups))

    def _check_strategy_against_reshard(self, where: str) -> None:
        # FULL_SHARD means "reshard after forward", SHARD_GRAD_OP means "keep parameters gathered until backward";
        # stating the opposite flag too is a contradiction, not an override.
        implied = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}.get(self.sharding_strategy)
        if implied is not None and self.reshard_after_forward not in (None, implied):
            raise FSDPConfigError(f"{where}sharding_strategy {self.sharding_strategy} implies reshard_after_forward="
                                  f"{str(implied).lower()}, but reshard_after_forward is "
                                  f"{str(self.reshard_after_forward).lower()}; remove one of the two")

    @classmethod
    def from_dict(cls, settings: Any) -> "XlaFSDPSettings":
        """Build from the JSON dict, rejecting keys that are not engine keywords."""
        if not isinstance(settings, Mapping):
            raise FSDPConfigError(f"xla_fsdp_settings must be a dict of engine keyword arguments, got "
                                  f"{_type_name(settings)} {settings!r}")
        for key in settings:
            if key in ENGINE_KEYWORDS:
                continue
            if key in _CALLABLE_KEYWORDS:
                raise FSDPConfigError(f"xla_fsdp_settings.{key} takes a Python callable, which JSON cannot express; "
                                      f"{_CALLABLE_KEYWORDS[key]}")
            if key in _TORCH_XLA_ONLY_KEYWORDS:
                raise FSDPConfigError(f"xla_fsdp_settings.{key} {_TORCH_XLA_ONLY_KEYWORDS[key]}")
            raise FSDPConfigError(f"unknown key {key!r} in xla_fsdp_settings; {_suggest(key, ENGINE_KEYWORDS)}")
        return cls(**dict(settings))

    def given(self) -> dict[str, Any]:
        """The fields that were set, as JSON values (canonical dtype and strategy names)."""
        out = {name: getattr(self, name) for name in ENGINE_KEYWORDS if getattr(self, name) is not None}
        if "sharding_groups" in out:
            out["sharding_groups"] = [list(g) for g in out["sharding_groups"]]
        return out

    def engine_kwargs(self) -> dict[str, Any]:
        """The given fields as engine keyword arguments (dtype names -> torch dtypes)."""
        kwargs = self.given()
        for name in ("compute_dtype", "buffer_dtype"):
            if name in kwargs:
                kwargs[name] = _DTYPES[kwargs[name]]
        return kwargs
