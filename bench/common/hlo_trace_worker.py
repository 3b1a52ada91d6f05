"""Trace (never execute) one training step on every device thread and dump its HLO.

Run as (bench/ on PYTHONPATH; `common.hlo_trace.trace` does it):
    CPU_NUM_DEVICES=8 PJRT_DEVICE=CPU python -m common.hlo_trace_worker OUT_DIR CONFIGS_JSON
where CONFIGS_JSON is a list of {"name", "model", "engine", "kwargs"}; each rank
writes OUT_DIR/<name>.rank<r>.hlo.
Explicit collectives across CPU devices hang when executed (see the notes on
XLA on CPU), but tracing is safe: each device thread builds the same wrapped
model, runs forward and backward lazily, and writes the HLO text of the graph
that would compute the shard gradients. Nothing here may force execution
(no .item(), no sync, execute_sharding_on_init=False).

MODEL is "mlp_nested" (a root unit and one nested unit), "gpt2" or
"gpt2_small" (auto-wrap on GPT2Block): common.models. Shared by tests/test_hlo.py,
tests/test_overlap.py, bench/comm_volume.py and bench/overlap.py.
"""
import json
import os
import sys
import threading

import torch

from common.models import build_model

_lock = threading.Lock()


def build(model_kind: str, engine: str, kwargs: dict, device):
    with _lock:  # device threads share the global RNG; keep construction whole
        model = build_model(model_kind)
    if engine == "torch_xla":
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as TXFSDP

        kwargs = {"execute_sharding_on_init": False, **kwargs}  # its init would execute the graph

        if model_kind.startswith("gpt2"):
            import functools

            from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
            return TXFSDP(model.to(device), auto_wrap_policy=policy, **kwargs)
        model[2] = TXFSDP(model[2].to(device), **kwargs)
        return TXFSDP(model.to(device), **kwargs)
    import xla_fsdp
    from xla_fsdp import FSDP

    kwargs = {"execute_sharding_on_init": False, **kwargs}
    root_strategy = kwargs.pop("root_sharding_strategy", None)  # the root's alone (blocks keep kwargs')
    if root_strategy is not None:
        block_kwargs = {"sharding_strategy": "FULL_SHARD", **kwargs}
        kwargs["sharding_strategy"] = root_strategy
        kwargs["auto_wrapper_callable"] = lambda m, **kw: FSDP(m, **{**kw, **block_kwargs})
    if model_kind.startswith("gpt2"):
        return FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]), **kwargs)
    model[2] = FSDP(model[2], **kwargs)
    return FSDP(model, **kwargs)


def trace_all(index: int, out_dir: str, configs: list) -> None:
    import torch_xla

    import gc

    for cfg in configs:
        gc.collect()  # drop the previous trace's tensors before starting a new graph
        # collectives chain through a per-device token (as after a step boundary, start a new chain)
        torch_xla._XLAC._set_all_reduce_token(str(torch_xla.device()), None)
        kwargs = {k: _parse_value(v) for k, v in cfg.get("kwargs", {}).items()}
        step_hlo(out_dir, cfg["name"], cfg["model"], cfg.get("engine", "xla_fsdp"), kwargs)


def step_hlo(out_dir: str, name: str, model_kind: str, engine: str, kwargs: dict) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    device = torch_xla.device()
    kwargs = dict(kwargs)
    logged_loss = kwargs.pop("logged_loss", False)  # trace the logged loss, not the step
    model = build(model_kind, engine, kwargs, device)
    if engine == "xla_fsdp":
        # a first forward teaches the units their order, as step 1 does for step 2 (prefetch
        # follows it); its graph is dropped: nothing is executed
        with torch.no_grad():
            if model_kind.startswith("gpt2"):
                model(input_ids=torch.zeros(2, 16, dtype=torch.long).to(device))
            else:
                model(torch.zeros(2, 32).to(device))
        # collectives chain through the device's token; a step boundary starts a new chain
        torch_xla._XLAC._set_all_reduce_token(str(device), None)
    if model_kind.startswith("gpt2"):
        ids = torch.zeros(2, 16, dtype=torch.long).to(device)
        loss = model(input_ids=ids, labels=ids).loss
    else:
        x = torch.zeros(2, 32).to(device)
        loss = model(x).float().pow(2).mean()
    if logged_loss:
        # What the training job reads at a logging step: the loss averaged
        # over the replicas (xla_fsdp.train.loop.StepContext.replica_mean).
        from xla_fsdp.train.loop import StepContext
        ctx = StepContext(device, replicas=xr.world_size())
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([ctx.replica_mean(loss.detach())])
    else:
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    rank = xr.global_ordinal()
    with open(os.path.join(out_dir, f"{name}.rank{rank}.hlo"), "w") as f:
        f.write(hlo)


def _parse_value(v):
    return torch.bfloat16 if v == "bfloat16" else v


def main():
    import torch_xla.distributed.xla_multiprocessing as xmp

    out_dir, configs = sys.argv[1], json.loads(sys.argv[2])
    xmp.spawn(trace_all, args=(out_dir, configs))


if __name__ == "__main__":
    main()
