"""The model families run_clm trains, keyed by the config's `model_type`.

One row per family: which transformers config and causal-LM classes build it. Everything else run_clm needs from a model
is read off the model itself: its decoder layer class is transformers' `_no_split_modules` (what Hugging Face's
`--fsdp auto_wrap` wraps), so the per-layer wrapping and checkpointing code has no family names in it. Parameter and
FLOP counts live in xla_fsdp/metrics.py."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Family:
    """How run_clm builds one transformers model family."""
    config_class: str     # transformers name, e.g. "LlamaConfig"
    model_class: str      # the causal LM, e.g. "LlamaForCausalLM"
    positions_key: str    # the config key that bounds --block_size, named in its error


FAMILIES = {
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", "n_positions"),
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "max_position_embeddings"),
}


def model_type_of(path: str) -> str:
    """The `model_type` a config file declares; a file without one is GPT-2, as `GPT2Config.from_json_file` has always
    read it here."""
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON file ({e}); give a transformers config JSON") from None
    if not isinstance(config, dict):
        raise ValueError(f"holds a JSON {type(config).__name__}, not an object of config keys")
    return config.get("model_type", "gpt2")


def family(model_type: str) -> Family:
    """The family of `model_type`; ValueError naming the supported ones for any other."""
    if model_type not in FAMILIES:
        supported = " or ".join(f'"{t}"' for t in FAMILIES)
        raise ValueError(f"model_type {model_type!r}: run_clm trains model_type {supported} "
                         f"(configs/models/ has examples of each)")
    return FAMILIES[model_type]


def transformers_class(name: str):
    import transformers
    return getattr(transformers, name)


def decoder_layer_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """The model's transformer layer class names (transformers' `_no_split_modules`: GPT2Block, LlamaDecoderLayer)."""
    names = tuple(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise SystemExit(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         f"give fsdp_transformer_layer_cls_to_wrap in --fsdp_config")
    return names


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, in order (GPT-2's transformer.h, Llama's model.layers)."""
    names = set(decoder_layer_classes(model))
    return [m for m in model.modules() if type(m).__name__ in names]
