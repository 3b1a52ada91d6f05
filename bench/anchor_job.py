"""The anchors' training step (torch_xla FSDPv1 and FSDPv2) as a job for the TPU check.

    python -m xla_fsdp.aot --tpu v4-8 -- launch/xla_spawn.py --num_cores 4 \\
        bench/anchor_job.py --engine fsdpv1 --config configs/models/gpt2-2b.json --batch 32 --grad_ckpt
    python -m xla_fsdp.aot --tpu v4-8 -- launch/xla_spawn.py --spmd \\
        bench/anchor_job.py --engine fsdpv2 --config configs/models/gpt2-2b.json --batch 32 --grad_ckpt

The blog's recipe as the Hugging Face Trainer runs it with `"xla": true`:
GPT-2 from a config, auto-wrapped on GPT2Block, gradient checkpointing on
every block when asked (`xla_fsdp_grad_ckpt`), Adafactor, and transformers'
default attention as launch/run_clm.py gets it (`--attn eager`: the blog's);
transformers' head and loss unless `--fused_loss` (run_clm's flag of that name).
- fsdpv1: `XlaFullyShardedDataParallel` with compute_dtype bf16, its other
  options at their defaults (pinned collectives), one process per chip.
- fsdpv2: `SpmdFullyShardedDataParallel` over a 1-D "fsdp" mesh of every
  device, the output sharded on the batch as the Trainer does, bf16 autocast
  (FSDPv2 has no compute_dtype).
Only meant for `python -m xla_fsdp.aot` (bench/tpu_perf_table.py runs it):
the model is built on the meta device and its parameters are torch_xla
placeholders (shapes, no buffers), so nothing may execute.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn as nn

from common.placeholders import to_placeholders


def build_meta_model(config_path: str, grad_ckpt: bool, attn: str = "", fused_loss: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config.from_json_file(config_path)
    config.use_cache = not grad_ckpt  # as the HF Trainer does with gradient checkpointing
    if attn == "pallas":  # run_clm's Pallas kernel (xla_fsdp/attention), so the anchors get it too
        from xla_fsdp import attention

        attention.check_config(config, config_path)
        attention.register()
    if attn:  # default: what launch/run_clm.py gets (transformers' default), so engines compare
        config._attn_implementation = attn
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    model.tie_weights()
    if attn == "pallas":  # run_clm's head-major projections around the kernel, so the anchors get them too
        from xla_fsdp.attention.gpt2_heads import use_head_major
        use_head_major(model)
    if fused_loss:  # run_clm's --fused_loss ([Note: fused output loss]), so the anchors get it too
        from xla_fsdp.loss import use_fused_loss
        use_fused_loss(model)
    return model


def fsdpv1(model: nn.Module, grad_ckpt: bool) -> nn.Module:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    extra = {"auto_wrapper_callable": lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)} if grad_ckpt else {}
    return FSDP(model, auto_wrap_policy=policy, compute_dtype=torch.bfloat16,
                param_init_fn=lambda m: to_placeholders(m, spmd=False), **extra)


def fsdpv2(model: nn.Module, grad_ckpt: bool):
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    if model.config._attn_implementation == "pallas":  # global tensors: the kernel takes the batch's spec
        from xla_fsdp import attention

        attention.use_mesh(mesh)
    to_placeholders(model, spmd=True)

    def shard_output(output, mesh):  # what the HF Trainer hands FSDPv2
        real = output if isinstance(output, torch.Tensor) else output.logits
        xs.mark_sharding(real, mesh, ("fsdp",) + (None,) * (real.dim() - 1))

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    extra = {"auto_wrapper_callable": lambda m, *a, **k: FSDPv2(checkpoint_module(m), *a, **k)} if grad_ckpt else {}
    return FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, shard_output=shard_output, **extra), mesh


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, choices=("fsdpv1", "fsdpv2"))
    p.add_argument("--config", required=True, help="a GPT-2 config JSON (configs/models/)")
    p.add_argument("--batch", type=int, default=8, help="sequences per device")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--grad_ckpt", action="store_true")
    p.add_argument("--optim", default="adafactor", choices=("adafactor", "adamw"))
    p.add_argument("--attn", default="", help="attention implementation (default: transformers' own, as "
                   "launch/run_clm.py); eager: the blog's transformers")
    p.add_argument("--fused_loss", action="store_true", help="run_clm's fused output loss instead of "
                   "transformers' head and loss (the blog's program)")
    args = p.parse_args(argv)

    import torch_xla
    import torch_xla.runtime as xr

    import xla_fsdp.aot

    if not xla_fsdp.aot.tracing():
        sys.exit("bench/anchor_job.py only runs under the TPU check: python -m xla_fsdp.aot --tpu v4-8 -- "
                 "launch/xla_spawn.py ... bench/anchor_job.py ...")
    if args.engine == "fsdpv2":
        xr.use_spmd()  # one program over every device, before any device work
    device = torch_xla.device()
    model = build_meta_model(args.config, args.grad_ckpt, args.attn, args.fused_loss)
    if args.engine == "fsdpv1":
        model, rows = fsdpv1(model, args.grad_ckpt), args.batch
        mesh = None
    else:
        import torch_xla.distributed.spmd as xs

        model, mesh = fsdpv2(model, args.grad_ckpt)
        rows = args.batch * xr.global_runtime_device_count()
    if args.optim == "adafactor":
        from transformers.optimization import Adafactor

        # what the Trainer builds for --optim adafactor
        optimizer = Adafactor(model.parameters(), lr=5e-5, scale_parameter=False, relative_step=False)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)

    def train_step():
        ids = torch.zeros(rows, args.seq, dtype=torch.long, device=device)
        if mesh is not None:
            xs.mark_sharding(ids, mesh, ("fsdp", None))
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=args.engine == "fsdpv2"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.engine == "fsdpv1":
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    xla_fsdp.aot.check(train_step)


def _mp_fn(index):
    main()


if __name__ == "__main__":
    main()
