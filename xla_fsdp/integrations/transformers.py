"""Hugging Face Trainer on xla_fsdp: `xla_fsdp.integrations.transformers.enable()`.

After `enable()`, a `transformers.Trainer` run with `--fsdp --fsdp_config cfg.json`, where `cfg.json` holds
`"xla": true`, wraps the model with xla_fsdp's collective engine instead of torch_xla's FSDP (with
`"xla_fsdp_v2": true`, with xla_fsdp's GSPMD engine instead of torch_xla's FSDPv2). Nothing in transformers is edited;
these names are replaced, each the narrowest point that serves (transformers 5.23; other versions are refused):

- `transformers.trainer.wrap_model_xla_fsdp`: wraps with the config's `xla_fsdp_settings` (dtype strings already
  converted by TrainingArguments), the layer classes or size threshold, and `xla_fsdp_grad_ckpt` as
  `FSDP(checkpoint_module(layer))`; a second call (a second `train()`) returns the model as it is.
- `transformers.trainer.save_tpu_checkpoint`: gathers the full model (every rank) and writes a `save_pretrained`
  directory on the main process (torch_xla's consolidation cannot read xla_fsdp's shards).
- `Trainer._clip_grad_norm` / `Trainer._get_grad_norm`: the norm over all shards (`model.clip_grad_norm_`), and marks
  the gradients synced, because Accelerate would otherwise all-reduce (sum) every rank's *different* shard gradients
  before the optimizer step on XLA.
- `Trainer.__init__`: refuses a URL `output_dir` (gs://...) before transformers makes a local folder `./gs:/...` of it
  (the Trainer writes with os and shutil: a bucket needs a gcsfuse mount); and turns `dataloader_pin_memory` off under
  the SPMD runtime, where torch's pin_memory fails and the Trainer would end at step 0.
- `Trainer._load_optimizer_and_scheduler`: refuses per-rank optimizer files of another world size, which transformers
  skips without a word (use `xla_fsdp.checkpoint` to reshard).
- `Trainer.compute_loss`: under the single controller, divides `num_items_in_batch` by the devices the batch is split
  over before the model sees it; `Trainer.get_optimizer_cls_and_kwargs`: no fused AdamW on XLA; and transformers'
  `is_tracing` (true inside the collective engine's per-device region). `enable()` also turns on the SPMD runtime under
  the single controller (`environment.runtime`). Why: transformers_runtime.py.

Gradient accumulation goes through Accelerate's `no_sync(model)`, which calls the model's `no_sync()`."""
from __future__ import annotations

import functools
import glob
import os
from typing import Any, Dict

from . import transformers_runtime as runtime

SUPPORTED = ("5.23",)

_originals: Dict[str, Any] = {}


def enable() -> None:
    """Route transformers.Trainer's XLA FSDP path to xla_fsdp (idempotent)."""
    import transformers
    import transformers.trainer as trainer_module

    version = ".".join(transformers.__version__.split(".")[:2])
    if version not in SUPPORTED:
        raise RuntimeError(
            f"xla_fsdp.integrations.transformers supports transformers {', '.join(SUPPORTED)}.x; this is "
            f"{transformers.__version__}. Install transformers==5.23.0 (requirements.txt), or wrap the model "
            "yourself and use a training loop")
    Trainer = trainer_module.Trainer
    # name -> (where it lives, ours in its place; None: transformers' own, without fused AdamW)
    ours = {"wrap_model_xla_fsdp": (trainer_module, wrap_model), "save_tpu_checkpoint": (trainer_module, save_checkpoint),
            "_clip_grad_norm": (Trainer, _clip_grad_norm), "_get_grad_norm": (Trainer, _get_grad_norm),
            "_load_optimizer_and_scheduler": (Trainer, _load_optimizer_and_scheduler),
            "get_optimizer_cls_and_kwargs": (Trainer, None), "compute_loss": (Trainer, _compute_loss),
            "__init__": (Trainer, _trainer_init)}
    missing = [name for name, (owner, _) in ours.items() if not callable(getattr(owner, name, None))]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__} has no {', '.join(missing)}; "
                           "xla_fsdp.integrations.transformers cannot patch it")
    runtime.set_up_runtime()
    runtime.steer_is_tracing()
    if _originals:
        return
    for name, (owner, replacement) in ours.items():
        _originals[name] = getattr(owner, name)
        setattr(owner, name, replacement or runtime.unfused_adamw(_originals[name]))


def _is_ours(model) -> bool:
    from xla_fsdp.api import XlaFullyShardedDataParallel

    return isinstance(model, XlaFullyShardedDataParallel)


def wrap_model(model, args, is_fsdp_xla_v2_enabled: bool):
    """`wrap_model_xla_fsdp` for xla_fsdp (same call shape)."""
    from xla_fsdp import checkpoint_module, wrap
    from xla_fsdp.api import XlaFullyShardedDataParallel as FSDP

    if _is_ours(model):
        return model
    runtime.steer_is_tracing()  # the model's modules are loaded by now
    config = args.fsdp_config
    kwargs: Dict[str, Any] = {}
    layer_names = config.get("transformer_layer_cls_to_wrap") or getattr(model, "_no_split_modules", None)
    if config.get("min_num_params", 0) > 0:
        kwargs["auto_wrap_policy"] = functools.partial(wrap.size_based_auto_wrap_policy,
                                                       min_num_params=config["min_num_params"])
    elif layer_names:
        present = {cls.__name__ for m in model.modules() for cls in type(m).__mro__}
        absent = sorted(set(layer_names) - present)
        if absent:
            raise ValueError(f"fsdp_config transformer_layer_cls_to_wrap names {absent}, which {type(model).__name__} "
                             "does not contain")
        kwargs["auto_wrap_policy"] = functools.partial(wrap.transformer_auto_wrap_policy,
                                                       transformer_layer_cls=set(layer_names))
    grad_ckpt = bool(config.get("xla_fsdp_grad_ckpt"))
    if grad_ckpt and getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # as transformers does: a recomputation would append to the cache twice
    prefetch = _prefetch_kwargs(config)
    if config.get("scan_layers", False) is not False:  # ours; the engine checks the value and what it needs
        kwargs["scan_layers"] = config["scan_layers"]
    if is_fsdp_xla_v2_enabled:
        if prefetch:
            raise ValueError(f"fsdp_config {sorted(prefetch)[0]} has no effect with xla_fsdp_v2 (the SPMD "
                             "partitioner places the gathers itself); remove it or set xla_fsdp_v2 to false")
        settings = dict(args.xla_fsdp_config)
        extra = sorted(set(settings) - {"compute_dtype", "buffer_dtype"})
        if extra:  # the SPMD engine takes these two only
            raise ValueError(f"fsdp_config xla_fsdp_settings {extra} have no effect with xla_fsdp_v2 (the SPMD "
                             "partitioner places the collectives); remove them or set xla_fsdp_v2 to false")
        return FSDP(model, engine="spmd", activation_checkpointing=grad_ckpt, **settings, **kwargs)
    if grad_ckpt:
        kwargs["auto_wrapper_callable"] = lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)
    return FSDP(model, **kwargs, **prefetch, **dict(args.xla_fsdp_config))


def _prefetch_kwargs(config) -> Dict[str, Any]:
    """fsdp_config's forward_prefetch / backward_prefetch (Hugging Face's names and spellings, "fsdp_" prefix already
    stripped by TrainingArguments) as engine keywords, checked."""
    from xla_fsdp.config import FSDPConfig

    forward, backward = config.get("forward_prefetch"), config.get("backward_prefetch")
    if isinstance(forward, str) and forward.lower() in ("true", "false"):
        forward = forward.lower() == "true"  # TrainingArguments reads it with str_to_bool too
    # checked and converted by our own config schema (an fsdp_config with only these keys)
    return FSDPConfig(xla=True, forward_prefetch=forward, backward_prefetch=backward).engine_kwargs()


def save_checkpoint(model, args, accelerator, processing_class, is_fsdp_xla_v1_enabled, output_dir=None):
    """`save_tpu_checkpoint` for xla_fsdp models (others go to transformers' own)."""
    if not _is_ours(model):
        return _originals["save_tpu_checkpoint"](model, args, accelerator, processing_class, is_fsdp_xla_v1_enabled,
                                                 output_dir)
    import torch

    from xla_fsdp.checkpoint.export import full_model_state
    from xla_fsdp.checkpoint.holdings import process_info

    output_dir = output_dir if output_dir is not None else args.output_dir
    state = full_model_state(model)  # collective: every rank
    if args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(args, os.path.join(output_dir, "training_args.bin"))
        model.save_pretrained(output_dir, state_dict=state, is_main_process=True)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
    process_info(model).barrier()


def _clip_grad_norm(self, model):
    if not _is_ours(model):
        return _originals["_clip_grad_norm"](self, model)
    self.accelerator.gradient_state.is_xla_gradients_synced = True  # reduced by the engine already
    return model.clip_grad_norm_(self.args.max_grad_norm)


def _get_grad_norm(self, model, grad_norm=None):
    if not _is_ours(model):
        return _originals["_get_grad_norm"](self, model, grad_norm=grad_norm)
    self.accelerator.gradient_state.is_xla_gradients_synced = True
    return grad_norm if grad_norm is not None else model.clip_grad_norm_(float("inf"))


def _compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    split = runtime.batch_split(model) if _is_ours(model) else 1
    if (split > 1 and num_items_in_batch is not None and self.model_accepts_loss_kwargs
            and self.label_smoother is None and self.compute_loss_func is None):
        # only the model's own loss reads it here: see transformers_runtime's docstring
        num_items_in_batch = num_items_in_batch / split
    return _originals["compute_loss"](self, model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)


def _load_optimizer_and_scheduler(self, checkpoint):
    if checkpoint is not None and self.is_fsdp_xla_v1_enabled:
        files = glob.glob(os.path.join(checkpoint, "rank*-of-*-optimizer.pt"))
        worlds = {os.path.basename(f).split("-of-")[1].split("-")[0] for f in files}
        if files and worlds != {str(self.args.world_size)}:
            raise ValueError(
                f"{checkpoint} holds optimizer state of world size {sorted(worlds)}, this run has "
                f"{self.args.world_size}; transformers would skip it and train with a fresh optimizer. Resume on "
                "the same number of devices, or save with xla_fsdp.checkpoint, which reshards")
    return _originals["_load_optimizer_and_scheduler"](self, checkpoint)


def _trainer_init(self, *args, **kwargs):
    training_args = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
    output_dir = getattr(training_args, "output_dir", None)
    if output_dir is not None:
        from xla_fsdp.checkpoint.storage import is_url

        if is_url(output_dir):
            raise ValueError(f"--output_dir {output_dir} is a URL: transformers' Trainer writes it with os and "
                             "shutil, which would make a local folder of that name. Give a local path (a gcsfuse "
                             "mount of the bucket works), or train with launch/run_clm.py, which writes URLs")
    _originals["__init__"](self, *args, **kwargs)
    _no_pinned_memory_under_spmd(self.args)


def _no_pinned_memory_under_spmd(args) -> None:
    """Under the SPMD runtime torch's `pin_memory` asks for a PrivateUse1 hooks interface that torch_xla 2.9 does not
    register: the data loader's thread raises, and the Trainer ends at step 0 saying the epoch had no sample. Pinned
    host memory buys XLA's transfers nothing."""
    import torch_xla.runtime as xr

    if getattr(args, "dataloader_pin_memory", False) and xr.is_spmd():
        args.dataloader_pin_memory = False
        runtime.logger.warning("xla_fsdp: dataloader_pin_memory set to False: under the SPMD runtime torch's "
                               "pin_memory fails in torch_xla 2.9 (the data loader would hand out no batch)")
