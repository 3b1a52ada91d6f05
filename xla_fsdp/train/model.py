"""Model construction and the one place run_clm hands the model to an engine.

`wrap_model` is the only function that knows which engine runs: the collectives engine, the SPMD engine, or (no
`--fsdp`) plain replication. Everything that needs a sharding decision (the batch layout, the optimizer's parameters)
asks the object it returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xla_fsdp.metrics import num_params
from xla_fsdp.train import families
from xla_fsdp.train.args import DEFERRED_INIT_PARAMS

from xla_fsdp.runtime import environment


# [Note: eager attention on XLA] transformers builds GPT-2 with "sdpa" attention unless told otherwise, and torch 2.9
# lowers scaled_dot_product_attention on an XLA device to its math decomposition, which casts bf16 queries, keys and
# values to f32 first: the [batch, heads, seq, seq] scores, their softmax and dropout all live in f32. GPT-2's "eager"
# attention keeps both attention matmuls in bf16 (about 12% faster on the TPU-compiled 2B GPT-2 step on v4-8).
# `--attn_implementation eager` picks it; the default stays transformers' own, so run_clm trains the model transformers
# would build.
def load_config(path: str, attn_implementation: str | None = None):
    """The transformers config of `--config_name`, of the class its `model_type` names (GPT2Config, LlamaConfig:
    xla_fsdp/train/families.py); other model types are refused by name. `attn_implementation` ("eager" / "sdpa" /
    "pallas") overrides transformers' choice; "pallas" registers the kernel with transformers and refuses a config with
    attention dropout."""
    try:
        family = families.family(families.model_type_of(path))
    except ValueError as e:
        raise SystemExit(f"--config_name {path}: {e}") from None
    config = families.transformers_class(family.config_class).from_json_file(path)
    if attn_implementation == "pallas":
        from xla_fsdp import attention

        try:
            attention.check_config(config, f"--config_name {path}")
        except attention.KernelInputError as e:
            raise SystemExit(str(e)) from None
        attention.register()
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def wants_deferred_init(config, forced: bool) -> bool:
    """Deferred build when asked, or when the model would crowd host memory."""
    return forced or num_params(config) > DEFERRED_INIT_PARAMS


def build_model(config, deferred: bool) -> torch.nn.Module:
    """A randomly initialized causal LM of the config's family (`GPT2LMHeadModel`, `LlamaForCausalLM`), on the host or
    deferred.

    Deferred: no parameter storage until the engine materializes each unit right after wrapping it, so no host ever
    holds the whole fp32 model."""
    model_class = families.transformers_class(families.family(config.model_type).model_class)
    if deferred:
        import xla_fsdp  # lazy: the deferred-init module is optional for small runs
        return xla_fsdp.deferred_init(model_class, config)
    return model_class(config)


def selected_engine(fsdp_config) -> str:
    """"spmd" (the GSPMD engine) when the fsdp config says xla_fsdp_v2; else "collectives". The runtime is a separate
    choice (`single_controller`). A variable that once chose the engine is refused by name
    (`environment.refuse_removed`)."""
    try:
        environment.refuse_removed()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return "spmd" if fsdp_config is not None and fsdp_config.use_spmd else "collectives"


def single_controller(engine: str) -> bool:
    """Whether this process drives every device of its host (torch_xla's SPMD runtime).

    Always for the GSPMD engine; for the collective engine when the environment asks for it (`environment.runtime`: the
    launcher exports it, or torch_xla's SPMD variable is true)."""
    try:
        runtime = environment.runtime()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return engine == "spmd" or runtime == environment.SINGLE_CONTROLLER


def load_fsdp_config(path: str | None):
    """The validated HF fsdp_config, or None without `--fsdp_config`."""
    if path is None:
        return None
    from xla_fsdp.config import load_fsdp_config as load  # lazy: needs only for FSDP runs
    try:
        return load(path)
    except ValueError as e:
        message = str(e)  # the loader names the file first: say it once
        raise SystemExit(f"--fsdp_config {path}: {message.removeprefix(f'{path}: ')}") from None


@dataclass
class Wrapped:
    """The trainable model and how its batches must be laid out."""
    model: torch.nn.Module
    engine: str                      # "spmd" | "collectives" | "none"
    mesh: object = None              # single controller: the mesh the batch is split over
    kwargs: dict = field(default_factory=dict)

    @property
    def reduces_grads(self) -> bool:
        """Whether the engine (or the SPMD partitioner) already reduces gradients across data-parallel ranks; if not,
        the loop all-reduces them."""
        return self.engine != "none" or self.mesh is not None


def engine_kwargs(args, fsdp_config, layer_classes=("GPT2Block",)) -> dict:
    """Engine keyword arguments from `--fsdp_config` and the `--fsdp` string; `layer_classes`: the model's decoder layer
    classes, for a bare `auto_wrap`."""
    kwargs = dict(fsdp_config.engine_kwargs()) if fsdp_config is not None else {}
    if args.auto_wrap and "auto_wrap_policy" not in kwargs:
        # HF's `--fsdp auto_wrap` without a policy wraps the model's no-split layer class: GPT2Block, LlamaDecoderLayer.
        from xla_fsdp.wrap import transformer_auto_wrap_policy
        import functools
        kwargs["auto_wrap_policy"] = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=set(layer_classes))
    if args.sharding_strategy and args.sharding_strategy != "FULL_SHARD":
        kwargs["sharding_strategy"] = args.sharding_strategy
    return kwargs


def wrap_model(model: torch.nn.Module, args, fsdp_config, device, engine: str, spmd: bool) -> Wrapped:
    """Hand `model` to `engine` ("spmd" or "collectives"; `spmd`: the single-controller runtime is on); the only
    engine-specific code in run_clm."""
    if args.gradient_checkpointing:
        # Not HF's gradient_checkpointing_enable(): torch.utils.checkpoint has no XLA device module, and XLA's CSE would
        # undo a plain recompute anyway.
        from xla_fsdp import checkpoint_module
        for layer in families.decoder_layers(model):
            checkpoint_module(layer)
    if fsdp_config is not None:
        try:
            fsdp_config.check_model(model)
        except ValueError as e:  # a key that does not fit this model (FSDPConfigError)
            raise SystemExit(f"--fsdp_config {args.fsdp_config}: {e}") from None
    mesh = None
    if spmd:
        from xla_fsdp.runtime.mesh import build_fsdp_mesh
        mesh = build_fsdp_mesh()
    if not args.sharding_strategy:
        # No --fsdp: every rank holds the whole model (plain data parallel).
        if fsdp_config is not None:
            raise SystemExit("--fsdp_config was given without --fsdp; add e.g. --fsdp full_shard")
        model = model.to(device)
        # Module.to() gives XLA copies new Parameters, untying lm_head from wte.
        model.tie_weights()
        return Wrapped(model, "none", mesh)
    import xla_fsdp
    kwargs = engine_kwargs(args, fsdp_config, families.decoder_layer_classes(model) if args.auto_wrap else ())
    if engine == "spmd":
        kwargs["engine"] = "spmd"
        kwargs.setdefault("mesh", mesh)
    else:
        kwargs.pop("engine", None)
    # The engine places each unit on the device itself (after materializing it, if deferred); moving the model first
    # would untie lm_head from wte.
    wrapped = xla_fsdp.XlaFullyShardedDataParallel(model, **kwargs)
    if engine == "collectives" and spmd:
        mesh = wrapped.device_mesh  # the batch is split over the devices the engine placed
    return Wrapped(wrapped, engine, mesh, kwargs)
