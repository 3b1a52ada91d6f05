"""Time to the first step on XLA:CPU, scan_layers against the unscanned SPMD engine and
torch_xla's FSDPv2, as the depth grows.

    python bench/compile_time.py [--layers 2 4 8 16 32 48] [--devices 4]
                                 [--engines scan scan_per_step spmd fsdpv2 collectives_scan collectives]
                                 [--json OUT]

For each depth and engine a fresh process (SPMD, `--devices` virtual CPU devices)
builds a GPT-2 of width 128 (4 heads, vocabulary 512, no dropout), shards it,
and runs three AdamW steps on 8 sequences of 64 tokens (steps 1 and 2 each compile a
program: AdamW's state appears after step 1; step 3 runs compiled):
- scan: `XlaFullyShardedDataParallel(engine="spmd", scan_layers=True)`, GPT2Block units
  (parameters stored stacked);
- scan_per_step: the same with `scan_layers="per_step"` (per-layer parameters, stacked every step);
- spmd: the same without scan_layers;
- fsdpv2: torch_xla 2.9's `SpmdFullyShardedDataParallel`, GPT2Block units;
- collectives_scan: the collectives engine (the single controller) with scan_layers (parameters
  stored stacked), every block
  checkpointed ([Note: scanning units of the collectives engine]);
- collectives: the same without scan_layers.
Columns: trace seconds of steps 1 and 2 (forward, backward and optimizer step
recorded lazily, up to each step's sync), XLA:CPU compile seconds (torch_xla's
CompileTime metric, every graph of steps 1 and 2), their wall time, and step 3's wall
time (the compiled program's speed). These are CPU figures: what they say about a TPU is
only that the program stops growing with depth; TPU compile times come from
`python -m xla_fsdp.aot`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ENGINES = ("scan", "scan_per_step", "spmd", "fsdpv2", "collectives_scan", "collectives")


def worker(engine: str, layers: int) -> dict:
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=128, n_layer=layers, n_head=4, vocab_size=512, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    if engine == "fsdpv2":
        import functools

        import numpy as np
        import torch_xla.distributed.spmd as xs
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        n = xr.global_runtime_device_count()
        xs.set_global_mesh(xs.Mesh(np.arange(n), (n, 1), ("fsdp", "tensor")))
        model = SpmdFullyShardedDataParallel(
            model.to(torch_xla.device()),
            shard_output=lambda out, mesh: xs.mark_sharding(
                out if isinstance(out, torch.Tensor) else out.logits, mesh, ("fsdp", None, None)),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}))
    elif engine.startswith("collectives"):
        import xla_fsdp
        from xla_fsdp import FSDP
        from xla_fsdp.collective_engine.manual_region import steer_is_tracing

        steer_is_tracing()  # transformers' mask code, inside the single controller's region
        model = FSDP(model.to(torch_xla.device()), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                     auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw),
                     scan_layers=engine == "collectives_scan")
    else:
        import xla_fsdp
        from xla_fsdp.wrap import transformer_auto_wrap_policy
        import functools

        model = xla_fsdp.XlaFullyShardedDataParallel(
            model, engine="spmd", scan_layers={"scan": True, "scan_per_step": "per_step"}.get(engine, False),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={"GPT2Block"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(3):
        ids = torch.randint(0, 512, (8, 64), generator=gen).to(torch_xla.device())
        started = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        loss = out.loss if hasattr(out, "loss") else out[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        traced = time.perf_counter()
        torch_xla.sync()
        loss.item()
        times.append((traced - started, time.perf_counter() - started))
        if len(times) == 2:  # step 1 and step 2 (AdamW's state appears after step 1) each compile
            data = met.metric_data("CompileTime")
            compile_s = 0.0 if data is None else data[1] / 1e9
    return {"engine": engine, "layers": layers, "trace_s": round(times[0][0] + times[1][0], 2),
            "compile_s": round(compile_s, 2), "first_steps_s": round(times[0][1] + times[1][1], 2),
            "step_s": round(times[2][1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 48])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=["scan", "spmd", "fsdpv2"])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", nargs=2, metavar=("ENGINE", "LAYERS"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        print("ROW " + json.dumps(worker(opts.worker[0], int(opts.worker[1]))), flush=True)
        return
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(opts.devices), XLA_USE_SPMD="1")
    rows = []
    print(f"{'layers':>6} {'engine':>16} {'trace s':>8} {'compile s':>9} {'steps 1-2 s':>11} {'step 3 s':>9}")
    for layers in opts.layers:
        for engine in opts.engines:
            got = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", engine, str(layers)],
                                 env=env, capture_output=True, text=True)
            line = [l for l in got.stdout.splitlines() if l.startswith("ROW ")]
            if got.returncode or not line:
                print(f"{layers:>6} {engine:>16} failed rc={got.returncode}: {got.stderr[-600:]}")
                continue
            row = json.loads(line[-1][4:])
            rows.append(row)
            print(f"{layers:>6} {engine:>16} {row['trace_s']:>8} {row['compile_s']:>9} "
                  f"{row['first_steps_s']:>11} {row['step_s']:>9}", flush=True)
    by = {(r["engine"], r["layers"]): r for r in rows}
    lo, hi = min(opts.layers), max(opts.layers)
    for engine in opts.engines:
        if (engine, lo) in by and (engine, hi) in by:
            a, b = by[(engine, lo)], by[(engine, hi)]
            ratio = (b["trace_s"] + b["compile_s"]) / max(a["trace_s"] + a["compile_s"], 1e-9)
            print(f"{engine}: trace + compile at {hi} layers / at {lo} layers = {ratio:.2f}x")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "devices": opts.devices,
                       "command": "python bench/compile_time.py " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
