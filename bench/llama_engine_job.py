"""The FSDP2 example's Llama under the other engines, as a job for the TPU check.

    python -m xla_fsdp.aot --tpu v4-8 --runtime single_controller -- \\
        bench/llama_engine_job.py --engine xla_fsdp --preset 1b --batch 8 --seq 2048 --ac

The model, loss, optimizer and clipping of examples/fsdp2_llama.py's step
(its own `Llama` class, AdamW, cross entropy in float32, clipping at 1.0),
so bench/fsdp2_step.py can set the example's `fully_shard` step beside:
- xla_fsdp: `XlaFullyShardedDataParallel` (the collective engine on the
  single controller), auto-wrapped by DecoderLayer, bf16 compute with float32
  reduce-scatters (what `MixedPrecisionPolicy(bfloat16, float32)` maps to);
  `--ac`: each layer recomputed (`FSDP(checkpoint_module(layer))`).
- fsdpv2: torch_xla's `SpmdFullyShardedDataParallel` over a 1-D "fsdp" mesh,
  auto-wrapped by DecoderLayer, bf16 autocast (FSDPv2 has no compute dtype),
  the logits sharded on the batch as the HF Trainer does; `--ac`: torch_xla's
  `checkpoint_module` on each layer.
Only meant for `python -m xla_fsdp.aot`: parameters are placeholders (shapes,
no buffers), so nothing may execute.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

from common import examples
from common.placeholders import to_placeholders

XLA_FSDP_TPU_RUNTIME = "single_controller"  # both engines: one program over every chip


def xla_fsdp_engine(model, ac: bool, fp32_reduce: bool = True):
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp import checkpoint_module
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    decoder_layer = examples.load("fsdp2_llama").DecoderLayer
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={decoder_layer})
    extra = {"auto_wrapper_callable": lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)} if ac else {}
    return FSDP(model, auto_wrap_policy=policy, compute_dtype=torch.bfloat16, fp32_reduce_scatter=fp32_reduce,
                **extra)


def fsdpv2_engine(model, ac: bool):
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    to_placeholders(model, spmd=True)

    def shard_output(output, mesh):
        xs.mark_sharding(output, mesh, ("fsdp",) + (None,) * (output.dim() - 1))

    decoder_layer = examples.load("fsdp2_llama").DecoderLayer
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={decoder_layer})
    extra = {"auto_wrapper_callable": lambda m, *a, **k: FSDPv2(checkpoint_module(m), *a, **k)} if ac else {}
    return FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, shard_output=shard_output, **extra), mesh


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, choices=("xla_fsdp", "fsdpv2"))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per chip")
    p.add_argument("--seq", type=int, default=0, help="default: the preset's max_seq_len")
    p.add_argument("--ac", action="store_true", help="recompute each DecoderLayer in backward")
    p.add_argument("--bf16_reduce", action="store_true",
                   help="xla_fsdp: reduce-scatter gradients in bf16 (what FSDPv2 does under autocast)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)

    import torch_xla
    import torch_xla.runtime as xr

    import xla_fsdp.aot

    example = examples.load("fsdp2_llama")

    if not xla_fsdp.aot.tracing():
        sys.exit("bench/llama_engine_job.py only runs under the TPU check: python -m xla_fsdp.aot --tpu v4-8 "
                 "--runtime single_controller -- bench/llama_engine_job.py ...")
    xr.use_spmd()  # no-op when the check entered the single controller already
    cfg = example.PRESETS[args.preset]
    seq = args.seq or cfg.max_seq_len
    device = torch_xla.device()
    with torch.device("meta"):
        model = example.Llama(cfg)
    mesh = None
    if args.engine == "xla_fsdp":
        model = xla_fsdp_engine(model, args.ac, fp32_reduce=not args.bf16_reduce)
    else:
        import torch_xla.distributed.spmd as xs

        model, mesh = fsdpv2_engine(model, args.ac)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    rows = args.batch * xr.global_runtime_device_count()  # the host's batch: every chip's share

    def train_step():
        batch = torch.zeros(rows, seq + 1, dtype=torch.long, device=device)
        if mesh is not None:
            xs.mark_sharding(batch, mesh, ("fsdp", None))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=args.engine == "fsdpv2"):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if args.engine == "xla_fsdp":
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    xla_fsdp.aot.check(train_step)


if __name__ == "__main__":
    main()
