"""Hugging Face `fsdp_config` JSON -> validated `FSDPConfig` -> engine keywords.

Users bring the JSON they pass to the Hugging Face Trainer as `--fsdp_config fsdp_config.json`. This module reads it,
rejects what would otherwise be silently ignored (misspelt keys, keys only the torch-FSDP path reads, contradictory
combinations), and turns it into keyword arguments for `xla_fsdp.XlaFullyShardedDataParallel`. The keys and the
checks on single values are in `schema.py`. Engine modules are imported lazily, so loading a config never pulls in
torch_xla."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from .schema import (_TOP_LEVEL_ALIASES, _TOP_LEVEL_KEYS, _TORCH_FSDP_ONLY_KEYS, BACKWARD_PREFETCH_CHOICES,
                     ENGINE_KEYWORDS, SPMD_ENGINE_KEYWORDS, FSDPConfigError, XlaFSDPSettings, _canonical_choice,
                     _check_bool, _check_int, _suggest, _type_name)


def checkpointed_wrapper(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """`auto_wrapper_callable` for `xla_fsdp_grad_ckpt`: checkpoint the layer, then shard it.

    A module-level function rather than a lambda so that engine options holding it stay picklable and print by name."""
    # lazy: the engine is not needed to load a config
    from xla_fsdp.activation_checkpoint import checkpoint_module
    from xla_fsdp.api import XlaFullyShardedDataParallel

    return XlaFullyShardedDataParallel(checkpoint_module(module), *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
    """A validated Hugging Face `fsdp_config` for XLA FSDP.

    Build it with `load_fsdp_config(path_or_dict)`; direct construction is validated the same way (lists and dicts are
    normalized to tuples and `XlaFSDPSettings`)."""

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
    scan_layers: Union[bool, str] = False
    """Key `scan_layers` (ours): run the wrapped repeated layers as one XLA loop. true stores their
    parameters stacked (the collectives engine: on the single controller, with xla_fsdp_grad_ckpt),
    "per_step" keeps per-layer parameters and stacks them every step."""
    forward_prefetch: Optional[bool] = None
    """HF key `forward_prefetch`: gather the next unit while this one computes; None = engine default (on)."""
    backward_prefetch: Optional[str] = None
    """HF key `backward_prefetch`: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH; None = engine default."""

    def __post_init__(self) -> None:
        for key in ("xla", "xla_fsdp_grad_ckpt", "xla_fsdp_v2"):
            _check_bool(key, getattr(self, key))
        if self.scan_layers != "per_step" and type(self.scan_layers) is not bool:
            raise FSDPConfigError(f"scan_layers must be true, false or \"per_step\", got "
                                  f"{_type_name(self.scan_layers)} {self.scan_layers!r}")
        if self.forward_prefetch is not None:
            _check_bool("forward_prefetch", self.forward_prefetch)
        if self.backward_prefetch is not None:
            object.__setattr__(self, "backward_prefetch", _canonical_choice(
                "backward_prefetch", self.backward_prefetch, BACKWARD_PREFETCH_CHOICES, upper=True))
        if isinstance(self.min_num_params, float) and self.min_num_params.is_integer():
            # JSON has no integer exponent form, so thresholds get written as 1e8.
            object.__setattr__(self, "min_num_params", int(self.min_num_params))
        _check_int("fsdp_min_num_params", self.min_num_params, 0)
        if not isinstance(self.xla_fsdp_settings, XlaFSDPSettings):  # from_dict refuses what is not a dict
            object.__setattr__(self, "xla_fsdp_settings", XlaFSDPSettings.from_dict(self.xla_fsdp_settings))
        object.__setattr__(self, "transformer_layer_cls_to_wrap", _layer_names(self.transformer_layer_cls_to_wrap))
        self._check_combinations()

    def _check_combinations(self) -> None:
        settings = self.xla_fsdp_settings
        if self.transformer_layer_cls_to_wrap and self.min_num_params > 0:
            # Hugging Face silently lets min_num_params win; refuse rather than guess.
            raise FSDPConfigError("fsdp_transformer_layer_cls_to_wrap and fsdp_min_num_params are mutually exclusive "
                                  "auto-wrap policies; keep one (layer classes for transformers, e.g. [\"GPT2Block\"])")
        if self.xla_fsdp_grad_ckpt and not self.xla:
            raise FSDPConfigError("xla_fsdp_grad_ckpt requires xla: true (it checkpoints XLA FSDP units); set "
                                  "\"xla\": true or drop xla_fsdp_grad_ckpt")
        if self.xla_fsdp_grad_ckpt and not self.uses_auto_wrap:
            raise FSDPConfigError("xla_fsdp_grad_ckpt requires an auto-wrap policy (it checkpoints each auto-wrapped "
                                  "layer); add fsdp_transformer_layer_cls_to_wrap, e.g. [\"GPT2Block\"], or "
                                  "fsdp_min_num_params")
        if settings.checkpoint_all_but_last and not self.xla_fsdp_grad_ckpt:
            raise FSDPConfigError("xla_fsdp_settings.checkpoint_all_but_last chooses which checkpointed layers keep "
                                  "their activations, and xla_fsdp_grad_ckpt is off, so none is checkpointed; set "
                                  "\"xla_fsdp_grad_ckpt\": true or drop checkpoint_all_but_last")
        if settings.remat_policy is not None and not self.xla_fsdp_grad_ckpt:
            raise FSDPConfigError("xla_fsdp_settings.remat_policy says what checkpointed layers save, and "
                                  "xla_fsdp_grad_ckpt is off, so none is checkpointed; set \"xla_fsdp_grad_ckpt\": "
                                  "true or drop remat_policy")
        if self.scan_layers and not self.xla_fsdp_v2 and not self.xla_fsdp_grad_ckpt:
            raise FSDPConfigError("scan_layers on the collectives engine recomputes every layer in backward; set "
                                  "\"xla_fsdp_grad_ckpt\": true (or use xla_fsdp_v2)")
        if self.scan_layers and not self.uses_auto_wrap:
            raise FSDPConfigError("scan_layers scans the wrapped repeated layer; add fsdp_transformer_layer_cls_to_wrap "
                                  "naming it, e.g. [\"GPT2Block\"]")
        if self.xla_fsdp_v2 and not self.xla:
            raise FSDPConfigError("xla_fsdp_v2 requires xla: true; set \"xla\": true")
        ignored = [k for k in settings.given() if k not in SPMD_ENGINE_KEYWORDS] if self.xla_fsdp_v2 else []
        if "checkpoint_all_but_last" in ignored:
            raise FSDPConfigError("xla_fsdp_settings.checkpoint_all_but_last is not available with xla_fsdp_v2, whose "
                                  "xla_fsdp_grad_ckpt recomputes every layer; remove it or set xla_fsdp_v2 to false")
        if ignored:
            raise FSDPConfigError(f"xla_fsdp_settings.{ignored[0]} has no effect with xla_fsdp_v2 (the SPMD partitioner "
                                  f"places the collectives itself); remove {', '.join(ignored)} or set xla_fsdp_v2 to "
                                  f"false. With xla_fsdp_v2 xla_fsdp_settings takes only: "
                                  f"{', '.join(SPMD_ENGINE_KEYWORDS)}")
        prefetch = [k for k in ("forward_prefetch", "backward_prefetch") if getattr(self, k) is not None]
        if prefetch and self.xla_fsdp_v2:
            raise FSDPConfigError(f"{prefetch[0]} has no effect with xla_fsdp_v2 (the SPMD partitioner places the "
                                  "gathers itself); remove it or set xla_fsdp_v2 to false")
        given = prefetch[:1] or (["xla_fsdp_settings"] if settings.given() else [])
        if given and not self.xla:
            raise FSDPConfigError(f"{given[0]} is given but xla is false, so it would be ignored; set \"xla\": true")

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
        # lazy: see module docstring
        from xla_fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.transformer_layer_cls_to_wrap:
            # Names, not classes: the policy matches by class name, so the config does not need the model's module to be
            # imported.
            return functools.partial(transformer_auto_wrap_policy,
                                     transformer_layer_cls=set(self.transformer_layer_cls_to_wrap))
        return functools.partial(size_based_auto_wrap_policy, min_num_params=self.min_num_params)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `xla_fsdp.XlaFullyShardedDataParallel(module, **kwargs)`.

        The settings (dtype names -> torch dtypes), `auto_wrap_policy` when a policy is configured, and for
        `xla_fsdp_grad_ckpt` either `auto_wrapper_callable=checkpointed_wrapper` (collectives engine) or
        `activation_checkpointing=True` together with `engine="spmd"` (`xla_fsdp_v2`)."""
        if not self.xla:
            raise FSDPConfigError("this fsdp_config has xla: false, which selects Hugging Face's torch FSDP; xla_fsdp "
                                  "runs XLA FSDP only; set \"xla\": true")
        kwargs = self.xla_fsdp_settings.engine_kwargs()
        policy = self.auto_wrap_policy()
        if policy is not None:
            kwargs["auto_wrap_policy"] = policy
        if self.xla_fsdp_v2:
            kwargs["engine"] = "spmd"
            if self.xla_fsdp_grad_ckpt:
                # Under SPMD a unit is not an XlaFullyShardedDataParallel instance, so checkpointed_wrapper (which
                # builds one) would be wrong; the SPMD engine checkpoints its units itself, keeping the compute-dtype
                # casts inside the recomputation.
                kwargs["activation_checkpointing"] = True
        elif self.xla_fsdp_grad_ckpt:
            kwargs["auto_wrapper_callable"] = checkpointed_wrapper
        if self.scan_layers:  # both engines; the collectives one: [Note: scanning units of the collectives engine]
            kwargs["scan_layers"] = self.scan_layers
        if self.forward_prefetch is not None:
            kwargs["forward_prefetch"] = self.forward_prefetch
        if self.backward_prefetch is not None:
            kwargs["backward_prefetch"] = None if self.backward_prefetch == "NO_PREFETCH" else self.backward_prefetch
        return kwargs

    def check_model(self, model: torch.nn.Module) -> None:
        """Fail early if a layer class named in the config does not occur in `model`.

        Otherwise the policy would wrap nothing and the whole model would be one unit: it runs, but gathers every
        parameter at once."""
        # Base-class names count too: the wrap policy matches along the MRO.
        present = sorted({cls.__name__ for m in model.modules() for cls in type(m).__mro__})
        for name in self.transformer_layer_cls_to_wrap:
            if name not in present:
                close = difflib.get_close_matches(name, present, n=1, cutoff=0.6)
                layers = sorted(getattr(model, "_no_split_modules", None) or ())  # a transformers model's layer class
                if close:
                    hint = f"did you mean {close[0]!r}?"
                elif layers:
                    hint = f"its transformer layer class is {', '.join(repr(c) for c in layers)}"
                else:
                    hint = f"classes in the model: {', '.join(present)}"
                raise FSDPConfigError(f"fsdp_transformer_layer_cls_to_wrap names {name!r}, but no module of "
                                      f"{type(model).__name__} has that class; {hint}")

    def to_dict(self) -> dict[str, Any]:
        """The config as Hugging Face JSON (canonical `fsdp_`-prefixed keys); loads back equal."""
        out = {"xla": self.xla, "xla_fsdp_settings": self.xla_fsdp_settings.given(),
               "fsdp_transformer_layer_cls_to_wrap": list(self.transformer_layer_cls_to_wrap),
               "fsdp_min_num_params": self.min_num_params, "xla_fsdp_grad_ckpt": self.xla_fsdp_grad_ckpt,
               "xla_fsdp_v2": self.xla_fsdp_v2, "scan_layers": self.scan_layers,
               "fsdp_forward_prefetch": self.forward_prefetch, "fsdp_backward_prefetch": self.backward_prefetch}
        # the switches always (a forward_prefetch of false too); the rest only when set
        always = ("xla", "xla_fsdp_grad_ckpt", "xla_fsdp_v2", "fsdp_forward_prefetch")
        return {key: value for key, value in out.items() if value is not None and (value or key in always)}


def _layer_names(value: Any) -> tuple[str, ...]:
    # Hugging Face accepts a single class name as a string; so do we.
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise FSDPConfigError("fsdp_transformer_layer_cls_to_wrap must be a list of class-name strings, e.g. "
                              f"[\"GPT2Block\"]; got {_type_name(value)} {value!r}")
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
                raise FSDPConfigError(f"fsdp_config gives both {canonical!r} and its alias "
                                      f"{canonical[len('fsdp_'):]!r}; keep one")
            out[canonical] = value
            continue
        bare = key[len("fsdp_"):] if key.startswith("fsdp_") else key
        if bare in _TORCH_FSDP_ONLY_KEYS:
            raise FSDPConfigError(f"fsdp_config key {key!r} is not used by XLA FSDP: {_TORCH_FSDP_ONLY_KEYS[bare]}")
        if key in ENGINE_KEYWORDS:
            raise FSDPConfigError(f"fsdp_config key {key!r} is an engine option; move it into xla_fsdp_settings")
        raise FSDPConfigError(f"unknown key {key!r} in fsdp_config; {_suggest(key, list(valid))}")
    return out


def load_fsdp_config(source: Union[str, os.PathLike, Mapping, FSDPConfig]) -> FSDPConfig:
    """Read a Hugging Face `fsdp_config` (JSON path or already-loaded dict) and validate it.

    Raises `FSDPConfigError` (a ValueError) naming the offending key and the fix; for a path, the message starts with
    the path."""
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
            raise FSDPConfigError(f"{origin}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    elif isinstance(source, Mapping):
        raw = source
    else:
        raise TypeError(f"load_fsdp_config takes a JSON path or a dict, got {type(source).__name__}")
    if not isinstance(raw, Mapping):
        raise FSDPConfigError(f"{origin}: the top level must be a JSON object, got {_type_name(raw)}")
    try:
        # each canonical key is its field's name, less the prefix "fsdp_"; absent keys keep the field's default
        return FSDPConfig(**{key.removeprefix("fsdp_"): value for key, value in _canonical_top_level(raw).items()})
    except FSDPConfigError as e:
        if origin == "fsdp_config":
            raise
        raise FSDPConfigError(f"{origin}: {e}") from None
