"""Communication volume of one training step at world size 8, from traced HLO.

Traces (never executes) one forward+backward of a small GPT-2 (d 256, 4
layers, vocab 8192; `--model gpt2` for the tests' tiny one; auto-wrap on GPT2Block) on 8 XLA:CPU device threads, for xla_fsdp with
each gather implementation and for torch_xla's XlaFullyShardedDataParallel
(pinned layouts, its default), then counts collectives and the bytes each rank
sends on a ring:

    all-gather of an S-byte result       (N-1)/N * S
    reduce-scatter of an S-byte input    (N-1)/N * S
    all-reduce of S bytes                2(N-1)/N * S

The collective engine's single-controller runtime (one process driving the
8 devices, `torch_xla.runtime.use_spmd()`) is measured from the program XLA
compiles: one step is executed in a child process and the per-device
program is read from XLA's dump right after SPMD partitioning.

The ideal for FSDP is 3(N-1)/N * P (gather for forward, gather again for
backward, reduce-scatter gradients; P = fp32 parameter bytes). Both engines
keep the root unit gathered between its forward and backward by default
(disable_reshard_on_root), so the ideal is met with every unit resharded:
the figures are printed for that setting too.

    python bench/comm_volume.py [--world 8] [--model gpt2_small|gpt2]
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from common.hlo_trace import COLLECTIVES, ops, read, result_bytes, trace
from common.models import batch, build_model, loss_fn

RUNS = [
    ("xla_fsdp all_gather", "xla_fsdp", {"all_gather_impl": "all_gather"}),
    ("xla_fsdp all_reduce", "xla_fsdp", {"all_gather_impl": "all_reduce"}),
    ("torch_xla FSDPv1 (pinned)", "torch_xla", {}),
    ("xla_fsdp all_gather, root resharded", "xla_fsdp",
     {"all_gather_impl": "all_gather", "disable_reshard_on_root": False}),
    ("xla_fsdp all_reduce, root resharded", "xla_fsdp",
     {"all_gather_impl": "all_reduce", "disable_reshard_on_root": False}),
    ("torch_xla FSDPv1, root resharded", "torch_xla", {"disable_reshard_on_root": False}),
]


SINGLE_CONTROLLER_RUNS = [
    ("xla_fsdp single controller, all_gather", {"all_gather_impl": "all_gather"}),
    ("xla_fsdp single controller, all_reduce", {"all_gather_impl": "all_reduce"}),
    ("xla_fsdp single controller, root resharded", {"disable_reshard_on_root": False}),
]


def single_controller_child(model_kind: str, kwargs: dict) -> None:
    """One forward/backward under the single-controller runtime (XLA_FLAGS dumps the program)."""
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_xla

    import xla_fsdp

    model = xla_fsdp.FSDP(build_model(model_kind), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                          **kwargs)
    x, y = batch("gpt2", 0)
    loss_fn("gpt2", model, x.to(torch_xla.device()), y.to(torch_xla.device())).backward()
    torch_xla.sync()


def single_controller_program(model_kind: str, kwargs: dict, world: int) -> str:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(world),
                   XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning "
                             "--xla_dump_hlo_module_re=SyncTensorsGraph --xla_dump_hlo_pipeline_re=spmd-partitioner")
        env.pop("XLA_USE_SPMD", None)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model_kind, json.dumps(kwargs)],
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"single-controller child failed:\n{proc.stderr[-4000:]}")
        texts = [open(p).read() for p in glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt"))]
    return max(texts, key=lambda t: len(ops(t, "reduce-scatter")))


def ring_bytes(hlo: str, world: int):
    counts, sent = {}, 0.0
    frac = (world - 1) / world
    for op in COLLECTIVES:
        lines = ops(hlo, op)
        counts[op] = len(lines)
        for line in lines:
            size = result_bytes(line)
            if op == "all-gather":
                sent += frac * size
            elif op == "reduce-scatter":
                sent += frac * size * world
            else:
                # torch_xla reduces its clipping/loss scalars too; count everything it sends
                sent += 2 * frac * size
    return counts, sent


def param_bytes(kind: str) -> int:
    model = build_model(kind)
    return sum(p.numel() for p in model.parameters()) * 4


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--model", default="gpt2_small", choices=["gpt2_small", "gpt2"])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        single_controller_child(args.child[0], json.loads(args.child[1]))
        return
    n = args.world
    configs = [{"name": f"run{i}", "model": args.model, "engine": engine, "kwargs": kwargs}
               for i, (_, engine, kwargs) in enumerate(RUNS)]
    with tempfile.TemporaryDirectory() as out:
        trace(configs, out, world=n, timeout=1800)
        texts = {c["name"]: read(out, c["name"], n)[0] for c in configs}
    p = param_bytes(args.model)
    ideal = 3 * (n - 1) / n * p
    print(f"{args.model}, world size {n}, fp32 parameter bytes P = {p:,}; ideal 3(N-1)/N*P = {ideal:,.0f} B/rank")
    print(f"{'engine':42s} {'all-gather':>10s} {'all-reduce':>10s} {'red-scatter':>11s} {'bytes/rank':>14s} {'x ideal':>8s}")
    rows = [(label, texts[cfg["name"]]) for (label, _, _), cfg in zip(RUNS, configs)]
    rows += [(label, single_controller_program(args.model, kwargs, n)) for label, kwargs in SINGLE_CONTROLLER_RUNS]
    for label, text in rows:
        counts, sent = ring_bytes(text, n)
        print(f"{label:42s} {counts['all-gather']:>10d} {counts['all-reduce']:>10d} "
              f"{counts['reduce-scatter']:>11d} {sent:>14,.0f} {sent / ideal:>8.3f}")


if __name__ == "__main__":
    main()
