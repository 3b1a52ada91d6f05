"""Hugging Face `fsdp_config` JSON -> validated `FSDPConfig` -> engine keywords.

Users bring the JSON they pass to the Hugging Face Trainer as
`--fsdp_config fsdp_config.json` (see docs/DESIGN.md and the recipe notes).
This module owns reading it, rejecting what would otherwise be silently
ignored (misspelt keys, keys only the torch-FSDP path reads, contradictory
combinations), and turning it into keyword arguments for
`xla_fsdp.XlaFullyShardedDataParallel`.

The engine modules are imported lazily inside the functions that need them so
that loading and validating a config never pulls in torch_xla or the engine.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

__all__ = [
    "ENGINE_KEYWORDS",
    "SPMD_ENGINE_KEYWORDS",
    "FSDPConfig",
    "FSDPConfigError",
    "XlaFSDPSettings",
    "checkpointed_wrapper",
    "load_fsdp_config",
]

# The keyword arguments of `xla_fsdp.XlaFullyShardedDataParallel` that a JSON
# file can express. `xla_fsdp_settings` accepts exactly these; the engine may
# import this tuple to keep the two lists from drifting apart.
ENGINE_KEYWORDS: tuple[str, ...] = (
    "reshard_after_forward",
    "flatten_parameters",
    "execute_sharding_on_init",
    "optimization_barrier_in_forward",
    "optimization_barrier_in_backward",
    "sync_on_finalization",
    "disable_reshard_on_root",
    "compute_dtype",
    "buffer_dtype",
    "fp32_reduce_scatter",
    "sharding_groups",
    "sharding_rank",
    "sharding_world_size",
    "shard_param_on_dim_0",
    "pin_layout_in_collective_ops",
    "reduce_scatter_bucket_size_mb",
    "all_gather_impl",
    "sharding_strategy",
)

# The settings the SPMD engine (`xla_fsdp_v2`) acts on. The others schedule
# explicit collectives, which under SPMD the XLA partitioner inserts itself,
# so giving them with xla_fsdp_v2 would be silently ignored.
SPMD_ENGINE_KEYWORDS: tuple[str, ...] = ("compute_dtype", "buffer_dtype")

# Engine keywords that take Python callables, which JSON cannot carry. Naming
# the JSON key that replaces each is kinder than "unknown key".
_CALLABLE_KEYWORDS: dict[str, str] = {
    "auto_wrap_policy": (
        "use the top-level key fsdp_transformer_layer_cls_to_wrap (a list of "
        "layer class names) or fsdp_min_num_params (an int) instead"
    ),
    "auto_wrapper_callable": (
        "set the top-level key xla_fsdp_grad_ckpt to true for per-layer "
        "gradient checkpointing instead"
    ),
    "param_init_fn": (
        "deferred initialization is set up by the training job, not the JSON; "
        "remove it (see xla_fsdp.deferred_init)"
    ),
}

# torch_xla constructor keywords that this engine does not take; users copying
# settings from torch_xla examples deserve a precise reason.
_TORCH_XLA_ONLY_KEYWORDS: dict[str, str] = {
    "coalesce_all_gather_ops": (
        "is a torch_xla keyword that xla_fsdp does not take; remove it "
        "(all_gather_impl chooses how parameters are gathered)"
    ),
}

# Canonical dtype names and the spellings accepted for each.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
}
_ALL_GATHER_IMPLS = ("all_gather", "all_reduce")
_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")

# Top-level keys. Newer Hugging Face versions strip the "fsdp_" prefix before
# reading the dict, so both spellings reach us in the wild.
_TOP_LEVEL_KEYS = (
    "xla",
    "xla_fsdp_settings",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params",
    "xla_fsdp_grad_ckpt",
    "xla_fsdp_v2",
)
_TOP_LEVEL_ALIASES: dict[str, str] = {
    "transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "min_num_params": "fsdp_min_num_params",
}

# Keys that only Hugging Face's torch-FSDP path (xla false) reads. Accepting
# them would let a user believe they had an effect on XLA FSDP.
_TORCH_FSDP_ONLY_HINT = (
    "it is read only by Hugging Face's torch FSDP path, which XLA FSDP does "
    "not use; remove it (engine options go in xla_fsdp_settings)"
)
_TORCH_FSDP_ONLY_KEYS: dict[str, str] = {
    **{key: _TORCH_FSDP_ONLY_HINT for key in (
        "version", "cpu_offload", "offload_params", "backward_prefetch", "forward_prefetch",
        "limit_all_gathers", "use_orig_params", "sync_module_states",
        "cpu_ram_efficient_loading", "state_dict_type",
    )},
    "activation_checkpointing": "use xla_fsdp_grad_ckpt for per-layer gradient checkpointing",
    "reshard_after_forward": "move it into xla_fsdp_settings",
    "auto_wrap_policy": (
        "the policy follows from fsdp_transformer_layer_cls_to_wrap or "
        "fsdp_min_num_params; remove it"
    ),
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
        raise FSDPConfigError(
            f"{key} must be a bool (true/false), got {_type_name(value)} {value!r}"
        )


def _check_int(key: str, value: Any, minimum: int) -> None:
    # bool is a subclass of int; `true` as a size or rank is a mistake.
    if type(value) is not int:
        raise FSDPConfigError(f"{key} must be an int, got {_type_name(value)} {value!r}")
    if value < minimum:
        raise FSDPConfigError(f"{key} must be >= {minimum}, got {value}")


def _canonical_dtype(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise FSDPConfigError(
            f"{key} must be a dtype name string such as \"bfloat16\", got "
            f"{_type_name(value)} {value!r}"
        )
    name = _DTYPE_ALIASES.get(value.lower())
    if name is None:
        raise FSDPConfigError(
            f"{key}: unknown dtype {value!r}; valid: " + ", ".join(_DTYPE_ALIASES)
        )
    return name


def _canonical_choice(key: str, value: Any, choices: tuple[str, ...], upper: bool) -> str:
    if not isinstance(value, str):
        raise FSDPConfigError(
            f"{key} must be a string, one of {', '.join(choices)}; got "
            f"{_type_name(value)} {value!r}"
        )
    # Sharding strategies are written lowercase in `--fsdp full_shard`; accept both cases.
    normalized = value.upper() if upper else value
    if normalized not in choices:
        raise FSDPConfigError(f"{key}: unknown value {value!r}; valid: {', '.join(choices)}")
    return normalized


_BOOL_SETTINGS = (
    "reshard_after_forward",
    "flatten_parameters",
    "execute_sharding_on_init",
    "optimization_barrier_in_forward",
    "optimization_barrier_in_backward",
    "sync_on_finalization",
    "disable_reshard_on_root",
    "fp32_reduce_scatter",
    "shard_param_on_dim_0",
    "pin_layout_in_collective_ops",
)


@dataclasses.dataclass(frozen=True)
class XlaFSDPSettings:
    """The `xla_fsdp_settings` dict: engine keyword arguments as JSON values.

    Every field defaults to None, meaning "not given: use the engine's
    default"; only given fields reach the engine, so this file never restates
    (and can never contradict) the engine's defaults.
    """

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
    """Shard each parameter along dim 0 (keeps shapes friendly to XLA layouts)."""
    pin_layout_in_collective_ops: Optional[bool] = None
    """Pin tensor layouts in collectives so all ranks compile identical programs."""
    reduce_scatter_bucket_size_mb: Optional[int] = None
    """Bucket gradients up to this many MiB per reduce-scatter; 0 disables bucketing."""
    all_gather_impl: Optional[str] = None
    """How parameters are gathered: "all_gather" or "all_reduce" (of zero-padded shards)."""
    sharding_strategy: Optional[str] = None
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD (case-insensitive; stored upper case)."""

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
        if self.all_gather_impl is not None:
            _canonical_choice(where + "all_gather_impl", self.all_gather_impl, _ALL_GATHER_IMPLS, upper=False)
        if self.sharding_strategy is not None:
            object.__setattr__(
                self,
                "sharding_strategy",
                _canonical_choice(where + "sharding_strategy", self.sharding_strategy,
                                  _SHARDING_STRATEGIES, upper=True),
            )
        if self.reduce_scatter_bucket_size_mb is not None:
            _check_int(where + "reduce_scatter_bucket_size_mb", self.reduce_scatter_bucket_size_mb, 0)
        self._check_sharding_groups(where)
        self._check_strategy_against_reshard(where)

    def _check_sharding_groups(self, where: str) -> None:
        # One JSON file is read by every process, so sharding_groups (the same
        # for all) is the useful key; the engine derives each process's
        # position from it and treats sharding_rank/sharding_world_size as
        # assertions. Only what can be checked without knowing the rank is checked here.
        if self.sharding_world_size is not None:
            _check_int(where + "sharding_world_size", self.sharding_world_size, 1)
        if self.sharding_rank is not None:
            _check_int(where + "sharding_rank", self.sharding_rank, 0)
            if self.sharding_world_size is not None and self.sharding_rank >= self.sharding_world_size:
                raise FSDPConfigError(
                    f"{where}sharding_rank {self.sharding_rank} is out of range for "
                    f"sharding_world_size {self.sharding_world_size}"
                )
        strategy = self.sharding_strategy
        groups = self.sharding_groups
        if groups is None:
            if strategy == "HYBRID_SHARD":
                raise FSDPConfigError(
                    f"{where}sharding_strategy HYBRID_SHARD needs {where}sharding_groups, "
                    f"e.g. [[0, 1, 2, 3], [4, 5, 6, 7]] (shard inside each group, replicate across)"
                )
            return
        if strategy == "NO_SHARD":
            raise FSDPConfigError(
                f"{where}sharding_strategy NO_SHARD replicates every parameter, so "
                f"{where}sharding_groups has no effect; remove one of the two"
            )
        if not isinstance(groups, (list, tuple)) or not groups or not all(
            isinstance(g, (list, tuple)) and g and all(type(r) is int and r >= 0 for r in g)
            for g in groups
        ):
            raise FSDPConfigError(
                f"{where}sharding_groups must be a non-empty list of non-empty lists of "
                f"non-negative int ranks, e.g. [[0, 1], [2, 3]]; got {groups!r}"
            )
        size = self.sharding_world_size if self.sharding_world_size is not None else len(groups[0])
        for group in groups:
            # Groups shard the same parameters, so they must cut them into the same number of pieces.
            if len(group) != size:
                raise FSDPConfigError(
                    f"{where}sharding_groups: group {list(group)} has {len(group)} ranks but "
                    + (f"sharding_world_size is {size}" if self.sharding_world_size is not None
                       else f"group {list(groups[0])} has {size}; all groups must be the same size")
                )
        ranks = [r for g in groups for r in g]
        if len(ranks) != len(set(ranks)):
            raise FSDPConfigError(f"{where}sharding_groups: a rank appears more than once: {groups!r}")
        # Frozen: store tuples, not the caller's (mutable) lists.
        object.__setattr__(self, "sharding_groups", tuple(tuple(g) for g in groups))

    def _check_strategy_against_reshard(self, where: str) -> None:
        # FULL_SHARD means "reshard after forward", SHARD_GRAD_OP means "keep
        # parameters gathered until backward"; stating the opposite flag too is
        # a contradiction, not an override.
        implied = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}.get(self.sharding_strategy)
        if implied is not None and self.reshard_after_forward is not None \
                and self.reshard_after_forward != implied:
            raise FSDPConfigError(
                f"{where}sharding_strategy {self.sharding_strategy} implies "
                f"reshard_after_forward={str(implied).lower()}, but "
                f"reshard_after_forward is {str(self.reshard_after_forward).lower()}; "
                f"remove one of the two"
            )

    @classmethod
    def from_dict(cls, settings: Any) -> "XlaFSDPSettings":
        """Build from the JSON dict, rejecting keys that are not engine keywords."""
        if not isinstance(settings, Mapping):
            raise FSDPConfigError(
                f"xla_fsdp_settings must be a dict of engine keyword arguments, got "
                f"{_type_name(settings)} {settings!r}"
            )
        for key in settings:
            if key in ENGINE_KEYWORDS:
                continue
            if key in _CALLABLE_KEYWORDS:
                raise FSDPConfigError(
                    f"xla_fsdp_settings.{key} takes a Python callable, which JSON "
                    f"cannot express; {_CALLABLE_KEYWORDS[key]}"
                )
            if key in _TORCH_XLA_ONLY_KEYWORDS:
                raise FSDPConfigError(f"xla_fsdp_settings.{key} {_TORCH_XLA_ONLY_KEYWORDS[key]}")
            raise FSDPConfigError(
                f"unknown key {key!r} in xla_fsdp_settings; {_suggest(key, ENGINE_KEYWORDS)}"
            )
        return cls(**dict(settings))

    def given(self) -> dict[str, Any]:
        """The fields that were set, as JSON values (canonical dtype and strategy names)."""
        out: dict[str, Any] = {}
        for name in ENGINE_KEYWORDS:
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = [list(g) for g in value] if name == "sharding_groups" else value
        return out

    def engine_kwargs(self) -> dict[str, Any]:
        """The given fields as engine keyword arguments (dtype names -> torch dtypes)."""
        kwargs = self.given()
        for name in ("compute_dtype", "buffer_dtype"):
            if name in kwargs:
                kwargs[name] = _DTYPES[kwargs[name]]
        return kwargs


def checkpointed_wrapper(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """`auto_wrapper_callable` for `xla_fsdp_grad_ckpt`: checkpoint the layer, then shard it.

    A module-level function rather than a lambda so that engine options
    holding it stay picklable and print by name.
    """
    import xla_fsdp  # lazy: the engine is not needed to load a config

    return xla_fsdp.XlaFullyShardedDataParallel(xla_fsdp.checkpoint_module(module), *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
    """A validated Hugging Face `fsdp_config` for XLA FSDP.

    Build it with `load_fsdp_config(path_or_dict)`; direct construction is
    validated the same way (lists and dicts are normalized to tuples and
    `XlaFSDPSettings`).
    """

    xla: bool = False
    """HF key `xla`: use XLA FSDP. False is Hugging Face's torch-FSDP path, which this library does not run."""
    xla_fsdp_settings: XlaFSDPSettings = dataclasses.field(default_factory=XlaFSDPSettings)
    """HF key `xla_fsdp_settings`: engine keyword arguments (see `ENGINE_KEYWORDS`)."""
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    """HF key `fsdp_transformer_layer_cls_to_wrap`: class names wrapped as one unit each; () = not set."""
    min_num_params: int = 0
    """HF key `fsdp_min_num_params`: size-based wrap threshold; 0 = not set (Hugging Face's default)."""
    xla_fsdp_grad_ckpt: bool = False
    """HF key `xla_fsdp_grad_ckpt`: gradient checkpointing on every auto-wrapped layer."""
    xla_fsdp_v2: bool = False
    """HF key `xla_fsdp_v2`: use the SPMD engine (`engine="spmd"`)."""

    def __post_init__(self) -> None:
        _check_bool("xla", self.xla)
        _check_bool("xla_fsdp_grad_ckpt", self.xla_fsdp_grad_ckpt)
        _check_bool("xla_fsdp_v2", self.xla_fsdp_v2)
        if isinstance(self.min_num_params, float) and self.min_num_params.is_integer():
            # JSON has no integer exponent form, so thresholds get written as 1e8.
            object.__setattr__(self, "min_num_params", int(self.min_num_params))
        _check_int("fsdp_min_num_params", self.min_num_params, 0)
        if isinstance(self.xla_fsdp_settings, Mapping):
            object.__setattr__(self, "xla_fsdp_settings", XlaFSDPSettings.from_dict(self.xla_fsdp_settings))
        elif not isinstance(self.xla_fsdp_settings, XlaFSDPSettings):
            raise FSDPConfigError(
                f"xla_fsdp_settings must be a dict of engine keyword arguments, got "
                f"{_type_name(self.xla_fsdp_settings)} {self.xla_fsdp_settings!r}"
            )
        object.__setattr__(
            self, "transformer_layer_cls_to_wrap", _layer_names(self.transformer_layer_cls_to_wrap)
        )
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.transformer_layer_cls_to_wrap and self.min_num_params > 0:
            # Hugging Face silently lets min_num_params win; refuse rather than guess.
            raise FSDPConfigError(
                "fsdp_transformer_layer_cls_to_wrap and fsdp_min_num_params are mutually "
                "exclusive auto-wrap policies; keep one (layer classes for transformers, "
                "e.g. [\"GPT2Block\"])"
            )
        if self.xla_fsdp_grad_ckpt and not self.xla:
            raise FSDPConfigError(
                "xla_fsdp_grad_ckpt requires xla: true (it checkpoints XLA FSDP units); "
                "set \"xla\": true or drop xla_fsdp_grad_ckpt"
            )
        if self.xla_fsdp_grad_ckpt and not self.uses_auto_wrap:
            raise FSDPConfigError(
                "xla_fsdp_grad_ckpt requires an auto-wrap policy (it checkpoints each "
                "auto-wrapped layer); add fsdp_transformer_layer_cls_to_wrap, e.g. "
                "[\"GPT2Block\"], or fsdp_min_num_params"
            )
        if self.xla_fsdp_v2 and not self.xla:
            raise FSDPConfigError("xla_fsdp_v2 requires xla: true; set \"xla\": true")
        if self.xla_fsdp_v2:
            ignored = [k for k in self.xla_fsdp_settings.given() if k not in SPMD_ENGINE_KEYWORDS]
            if ignored:
                raise FSDPConfigError(
                    f"xla_fsdp_settings.{ignored[0]} has no effect with xla_fsdp_v2 (the SPMD "
                    f"partitioner places the collectives itself); remove "
                    f"{', '.join(ignored)} or set xla_fsdp_v2 to false. With xla_fsdp_v2 "
                    f"xla_fsdp_settings takes only: {', '.join(SPMD_ENGINE_KEYWORDS)}"
                )
        if self.xla_fsdp_settings.given() and not self.xla:
            raise FSDPConfigError(
                "xla_fsdp_settings is given but xla is false, so it would be ignored; "
                "set \"xla\": true"
            )

    @property
    def use_spmd(self) -> bool:
        """Whether the SPMD engine is selected (`xla_fsdp_v2`)."""
        return self.xla_fsdp_v2

    @property
    def uses_auto_wrap(self) -> bool:
        """Whether an auto-wrap policy (layer classes or size threshold) is configured."""
        return bool(self.transformer_layer_cls_to_wrap) or self.min_num_params > 0

    def auto_wrap_policy(self) -> Optional[functools.partial]:
        """The engine's auto-wrap policy for this config, or None when none is configured."""
        if not self.uses_auto_wrap:
            return None
        from xla_fsdp import wrap  # lazy: see module docstring

        if self.transformer_layer_cls_to_wrap:
            # Names, not classes: the policy matches by class name, so the
            # config does not need the model's module to be imported.
            return functools.partial(
                wrap.transformer_auto_wrap_policy,
                transformer_layer_cls=set(self.transformer_layer_cls_to_wrap),
            )
        return functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=self.min_num_params)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `xla_fsdp.XlaFullyShardedDataParallel(module, **kwargs)`.

        The settings (dtype names -> torch dtypes), `auto_wrap_policy` when a
        policy is configured, and for `xla_fsdp_grad_ckpt` either
        `auto_wrapper_callable=checkpointed_wrapper` (collectives engine) or
        `activation_checkpointing=True` together with `engine="spmd"`
        (`xla_fsdp_v2`).
        """
        if not self.xla:
            raise FSDPConfigError(
                "this fsdp_config has xla: false, which selects Hugging Face's torch FSDP; "
                "xla_fsdp runs XLA FSDP only; set \"xla\": true"
            )
        kwargs = self.xla_fsdp_settings.engine_kwargs()
        policy = self.auto_wrap_policy()
        if policy is not None:
            kwargs["auto_wrap_policy"] = policy
        if self.xla_fsdp_v2:
            kwargs["engine"] = "spmd"
            if self.xla_fsdp_grad_ckpt:
                # Under SPMD a unit is not an XlaFullyShardedDataParallel
                # instance, so checkpointed_wrapper (which builds one) would be
                # wrong; the SPMD engine checkpoints its units itself, keeping
                # the compute-dtype casts inside the recomputation.
                kwargs["activation_checkpointing"] = True
        elif self.xla_fsdp_grad_ckpt:
            kwargs["auto_wrapper_callable"] = checkpointed_wrapper
        return kwargs

    def check_model(self, model: torch.nn.Module) -> None:
        """Fail early if a layer class named in the config does not occur in `model`.

        Otherwise the policy would wrap nothing and the whole model would be
        one unit: it runs, but gathers every parameter at once.
        """
        # Base-class names count too: the wrap policy matches along the MRO.
        present = sorted({cls.__name__ for m in model.modules() for cls in type(m).__mro__})
        for name in self.transformer_layer_cls_to_wrap:
            if name not in present:
                close = difflib.get_close_matches(name, present, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"classes in the model: {', '.join(present)}"
                raise FSDPConfigError(
                    f"fsdp_transformer_layer_cls_to_wrap names {name!r}, but no module of "
                    f"{type(model).__name__} has that class; {hint}"
                )

    def to_dict(self) -> dict[str, Any]:
        """The config as Hugging Face JSON (canonical `fsdp_`-prefixed keys); loads back equal."""
        out: dict[str, Any] = {"xla": self.xla}
        settings = self.xla_fsdp_settings.given()
        if settings:
            out["xla_fsdp_settings"] = settings
        if self.transformer_layer_cls_to_wrap:
            out["fsdp_transformer_layer_cls_to_wrap"] = list(self.transformer_layer_cls_to_wrap)
        if self.min_num_params:
            out["fsdp_min_num_params"] = self.min_num_params
        out["xla_fsdp_grad_ckpt"] = self.xla_fsdp_grad_ckpt
        out["xla_fsdp_v2"] = self.xla_fsdp_v2
        return out


def _layer_names(value: Any) -> tuple[str, ...]:
    # Hugging Face accepts a single class name as a string; so do we.
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise FSDPConfigError(
            "fsdp_transformer_layer_cls_to_wrap must be a list of class-name strings, "
            f"e.g. [\"GPT2Block\"]; got {_type_name(value)} {value!r}"
        )
    return tuple(value)


def _canonical_top_level(raw: Mapping) -> dict[str, Any]:
    """Map aliases to canonical keys and reject keys XLA FSDP would not honour."""
    out: dict[str, Any] = {}
    valid = _TOP_LEVEL_KEYS + tuple(_TOP_LEVEL_ALIASES)
    for key, value in raw.items():
        if not isinstance(key, str):
            raise FSDPConfigError(f"fsdp_config keys must be strings, got {key!r}")
        canonical = _TOP_LEVEL_ALIASES.get(key, key)
        if canonical in _TOP_LEVEL_KEYS:
            if canonical in out:
                raise FSDPConfigError(
                    f"fsdp_config gives both {canonical!r} and its alias "
                    f"{canonical[len('fsdp_'):]!r}; keep one"
                )
            out[canonical] = value
            continue
        bare = key[len("fsdp_"):] if key.startswith("fsdp_") else key
        if bare in _TORCH_FSDP_ONLY_KEYS:
            raise FSDPConfigError(f"fsdp_config key {key!r} is not used by XLA FSDP: {_TORCH_FSDP_ONLY_KEYS[bare]}")
        if key in ENGINE_KEYWORDS:
            raise FSDPConfigError(
                f"fsdp_config key {key!r} is an engine option; move it into xla_fsdp_settings"
            )
        raise FSDPConfigError(f"unknown key {key!r} in fsdp_config; {_suggest(key, list(valid))}")
    return out


def load_fsdp_config(source: Union[str, os.PathLike, Mapping, FSDPConfig]) -> FSDPConfig:
    """Read a Hugging Face `fsdp_config` (JSON path or already-loaded dict) and validate it.

    Raises `FSDPConfigError` (a ValueError) naming the offending key and the
    fix; for a path, the message starts with the path.
    """
    if isinstance(source, FSDPConfig):
        return source
    origin = "fsdp_config"
    if isinstance(source, (str, os.PathLike)):
        origin = os.fspath(source)
        try:
            with open(origin, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"fsdp_config file not found: {origin}") from None
        except json.JSONDecodeError as e:
            raise FSDPConfigError(
                f"{origin}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}"
            ) from None
    elif isinstance(source, Mapping):
        raw = source
    else:
        raise TypeError(
            f"load_fsdp_config takes a JSON path or a dict, got {type(source).__name__}"
        )
    if not isinstance(raw, Mapping):
        raise FSDPConfigError(f"{origin}: the top level must be a JSON object, got {_type_name(raw)}")
    try:
        keys = _canonical_top_level(raw)
        return FSDPConfig(
            xla=keys.get("xla", False),
            xla_fsdp_settings=keys.get("xla_fsdp_settings", {}),
            transformer_layer_cls_to_wrap=keys.get("fsdp_transformer_layer_cls_to_wrap", ()),
            min_num_params=keys.get("fsdp_min_num_params", 0),
            xla_fsdp_grad_ckpt=keys.get("xla_fsdp_grad_ckpt", False),
            xla_fsdp_v2=keys.get("xla_fsdp_v2", False),
        )
    except FSDPConfigError as e:
        if origin == "fsdp_config":
            raise
        raise FSDPConfigError(f"{origin}: {e}") from None
