"""Trace (never execute) one GPT-2 training step at real shapes and write the per-device program.

Used by bench/project_tpu.py, one configuration per process:

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python bench/tpu_trace.py OUT.hlo CONFIG_JSON

CONFIG_JSON: {"model": "configs/models/gpt2-2b.json", "engine": "xla_fsdp" |
"torch_xla" | "fsdpv2", "kwargs": {...}, "batch": 32, "seq": 1024,
"grad_ckpt": true}. "batch" is per device; "real_params": true (fsdpv2 only) traces
with real, uninitialized parameters instead of placeholders, to check them.

The model is built under torch.device("meta"), so no full parameter ever
exists. Values never matter (nothing runs), so units are materialized with
uninitialized storage (`_empty_like_meta`, no reset_parameters()).

- xla_fsdp and torch_xla FSDPv1 (one program per device): the step is traced
  on XLA:CPU device threads (xmp), but only on rank 0: every rank's program is
  the same text, and nothing collective runs while tracing (no execution), so
  ranks 1..N-1 return at once. Rank 0 holds only its shards (P/N fp32),
  which keeps the 2B model at ~2.2 GB instead of ~8.8 GB for four ranks. The
  text is `_get_xla_tensors_hlo` of the shard gradients (before XLA's passes).
- fsdpv2 (torch_xla's SpmdFullyShardedDataParallel, one program for the mesh):
  every parameter is an XLA *placeholder* (a shape, no buffer) plus one
  elementwise op, so `mark_sharding` annotates it without data (a sharded
  placeholder is refused). The partitioned per-device program is dumped by
  XLA after SPMD partitioning while `_xla_warm_up_cache` compiles (never runs)
  the step. Difference from a real run: each parameter enters replicated and
  is sliced locally (a dynamic-slice, no communication) before the
  partitioner gathers it exactly as for a sharded input.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import sys
import threading

import torch
import torch.nn as nn

_lock = threading.Lock()


def build_meta_model(config_path: str, grad_ckpt: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config.from_json_file(config_path)
    config.use_cache = not grad_ckpt  # as the HF Trainer does with gradient checkpointing
    # eager attention, as GPT-2 ran in the blog's transformers (bf16 QK^T and AV); torch 2.9's
    # math SDPA on XLA upcasts both attention matmuls to f32
    config._attn_implementation = "eager"
    with _lock, torch.device("meta"):
        model = GPT2LMHeadModel(config)
    model.tie_weights()
    return model


def _empty_like_meta(module: nn.Module, memo=None, make=None) -> None:
    """Give every meta parameter / buffer of `module` (not of FSDP-wrapped children: those are
    not meta any more) storage without initializing it; tied parameters stay tied."""
    memo = {} if memo is None else memo
    make = make or (lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(make(p), requires_grad=p.requires_grad)
                m._parameters[name] = memo[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


def _wrap_collective(model: nn.Module, engine: str, kwargs: dict, grad_ckpt: bool) -> nn.Module:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    if engine == "torch_xla":
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as TXFSDP
        from torch_xla.distributed.fsdp import checkpoint_module
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
        extra = {}
        if grad_ckpt:  # what the HF Trainer does for "xla_fsdp_grad_ckpt": true
            extra["auto_wrapper_callable"] = lambda m, *a, **k: TXFSDP(checkpoint_module(m), *a, **k)
        return TXFSDP(model, auto_wrap_policy=policy, param_init_fn=_empty_like_meta,
                      execute_sharding_on_init=False, **extra, **kwargs)
    import xla_fsdp

    kwargs = dict(kwargs)
    root_strategy = kwargs.pop("root_sharding_strategy", None)
    if root_strategy is not None:  # the root's alone (e.g. NO_SHARD: embeddings replicated); blocks FULL_SHARD
        kwargs["sharding_strategy"] = root_strategy
        kwargs["auto_wrapper_callable"] = lambda m, **kw: xla_fsdp.FSDP(m, **{**kw, "sharding_strategy": "FULL_SHARD"})
    return xla_fsdp.FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                         param_init_fn=_empty_like_meta, activation_checkpointing=grad_ckpt,
                         execute_sharding_on_init=False, **kwargs)


def _kwargs(cfg: dict) -> dict:
    return {k: (torch.bfloat16 if v == "bfloat16" else v) for k, v in cfg.get("kwargs", {}).items()}


def trace_rank(index: int, out_path: str, cfg: dict) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    if xr.global_ordinal() != 0:
        return  # see the module docstring: rank 0's program is every rank's
    device = torch_xla.device()
    model = _wrap_collective(build_meta_model(cfg["model"], cfg["grad_ckpt"]), cfg["engine"], _kwargs(cfg),
                             cfg["grad_ckpt"])
    if cfg["engine"] == "xla_fsdp":
        # a first forward teaches the units their order (prefetch follows it); nothing runs
        with torch.no_grad():
            model(input_ids=torch.zeros(2, 16, dtype=torch.long, device=device))
    torch_xla._XLAC._set_all_reduce_token(str(device), None)  # a step boundary starts a new chain
    ids = torch.zeros(cfg["batch"], cfg["seq"], dtype=torch.long, device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with open(out_path, "w") as f:
        f.write(torch_xla._XLAC._get_xla_tensors_hlo(grads))


def trace_fsdpv2(out_path: str, cfg: dict) -> None:
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.core import xla_builder as xb
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    model = build_meta_model(cfg["model"], cfg["grad_ckpt"])
    if cfg.get("real_params"):  # only to check the placeholders: real (uninitialized) storage
        _empty_like_meta(model)
    else:  # a placeholder has no buffer; `* 1` makes it an IR value mark_sharding can annotate
        _empty_like_meta(model, make=lambda t: xb.create_placeholder_tensor(tuple(t.shape), t.dtype) * 1)

    def shard_output(output, mesh):  # what the HF Trainer passes FSDPv2
        real = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else output.logits
        xs.mark_sharding(real, mesh, ("fsdp",) + (None,) * (real.dim() - 1))

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    extra = {"auto_wrapper_callable": lambda m, *a, **k: FSDPv2(checkpoint_module(m), *a, **k)} \
        if cfg["grad_ckpt"] else {}
    model = FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, shard_output=shard_output, **extra)
    ids = torch.zeros(cfg["batch"] * n, cfg["seq"], dtype=torch.long, device="xla")
    xs.mark_sharding(ids, mesh, ("fsdp", None))
    # FSDPv2 has no compute_dtype: matmuls in bf16 through autocast, parameters fp32
    with torch.autocast("xla", dtype=torch.bfloat16, enabled=cfg.get("autocast_bf16", True)):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # compile (never run) in the background; the partitioned program is dumped early in
    # compilation, and XLA:CPU's code generation after it is not needed: exit once it is there
    before = set(glob.glob(os.path.join(os.environ["TPU_TRACE_DUMP"], "*")))
    threading.Thread(target=torch_xla._XLAC._xla_warm_up_cache, args=(grads, []), daemon=True).start()
    text = _wait_for_dump(os.environ["TPU_TRACE_DUMP"], before)
    with open(out_path, "w") as f:
        f.write(text)
    sys.stdout.flush()
    import shutil

    shutil.rmtree(os.environ["TPU_TRACE_DUMP"], ignore_errors=True)
    os._exit(0)  # the compile thread is still in XLA


def _wait_for_dump(dump_dir: str, before: set, timeout: float = 1800.0) -> str:
    import time

    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        time.sleep(1.0)
        found = [p for p in glob.glob(os.path.join(dump_dir, "*after_spmd-partitioning*.txt")) if p not in before]
        if found:
            size = os.path.getsize(found[0])
            if size == last and size > 0:
                return open(found[0]).read()
            last = size
    raise TimeoutError("no partitioned program was dumped (is XLA_FLAGS set?)")


def main():
    out_path, cfg = sys.argv[1], json.loads(sys.argv[2])
    if cfg["engine"] == "fsdpv2":
        import tempfile

        dump = tempfile.mkdtemp(prefix="tpu_trace_dump_")
        os.environ["TPU_TRACE_DUMP"] = dump
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                   " --xla_dump_hlo_pass_re=spmd-partitioning --xla_dump_hlo_module_re=SyncTensorsGraph"
                                   " --xla_dump_hlo_pipeline_re=spmd-partitioner --xla_dump_disable_metadata=true")
        import atexit
        import shutil

        atexit.register(shutil.rmtree, dump, True)
        return trace_fsdpv2(out_path, cfg)
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(trace_rank, args=(out_path, cfg))


if __name__ == "__main__":
    main()
