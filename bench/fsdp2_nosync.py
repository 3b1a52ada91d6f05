"""An FSDP2 loop written for GPUs (no torch_xla.sync()) against the same loop with its own sync.

    python bench/fsdp2_nosync.py [--devices 4] [--steps 30] [--layers 4] [--dim 64]

Each loop trains a small decoder sharded with `xla_fsdp.fsdp.fully_shard` (per layer, then the
root) on N XLA:CPU devices in a fresh process, reading the loss each step as GPU loops log it,
and times every step. Printed side by side: the median of the first 10 steps after warm-up
(steps 4-13) and of the last 10, their ratio, and the graph cuts and compiles of the whole run.
`--without_cut` adds the GPU loop with xla_fsdp's step cut switched off, for its first 8 steps
(each compiles a longer program). XLA:CPU timings, not a TPU's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 3


def _child(mode: str, steps: int, layers: int, dim: int) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.debug.metrics as met

    import xla_fsdp.fsdp as fsdp
    from xla_fsdp.fsdp import step_cut

    if mode == "without_cut":
        step_cut.install = lambda: None  # the GPU loop as it ran before the step cut existed

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, dim)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.out = nn.Linear(dim, 256)

        def forward(self, t):
            x = self.emb(t)
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    device = torch.device("xla")
    model.to_empty(device=device)
    for m in model.modules():
        if hasattr(m, "reset_parameters") and not isinstance(m, fsdp.FSDPModule):
            m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens = torch.randint(0, 256, (16, 65), generator=gen).to(device)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if mode == "own_sync":
            torch_xla.sync()
        loss.item()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "cuts": met.counter_value("MarkStep") or 0,
            "compiles": met.metric_data("CompileTime")[0]}


def _run(mode: str, args) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(args.devices),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    steps = 8 if mode == "without_cut" else args.steps
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--steps", str(steps),
           "--layers", str(args.layers), "--dim", str(args.dim)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--without_cut", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.layers, args.dim)))
        return
    if args.steps < WARMUP + 20:
        parser.error(f"--steps must be at least {WARMUP + 20} (warm-up, then two windows of 10)")
    modes = ["gpu_loop", "own_sync"] + (["without_cut"] if args.without_cut else [])
    print(f"FSDP2 loop on {args.devices} XLA:CPU devices, {args.steps} steps, {args.layers} layers of width "
          f"{args.dim} ({time.strftime('%Y-%m-%d')})")
    print(f"{'loop':<28}{'first 10 (ms)':>14}{'last 10 (ms)':>14}{'last/first':>12}{'cuts':>7}{'compiles':>10}")
    for mode in modes:
        r = _run(mode, args)
        s = [x * 1000 for x in r["seconds"]]
        if mode == "without_cut":
            print(f"{'GPU loop, no step cut':<28}" + "  steps 1-8 (ms): " + ", ".join(f"{x:.0f}" for x in s))
            continue
        first = statistics.median(s[WARMUP:WARMUP + 10])
        last = statistics.median(s[-10:])
        label = "GPU loop (no sync)" if mode == "gpu_loop" else "own torch_xla.sync()"
        print(f"{label:<28}{first:>14.1f}{last:>14.1f}{last / first:>12.2f}{r['cuts']:>7}{r['compiles']:>10}")


if __name__ == "__main__":
    main()
