"""PROJECTED TPU step time and MFU of one GPT-2 training step, from the traced program.

Nothing here runs on a TPU and nothing is measured: every printed time is a
projection from published chip figures (xla_fsdp/tpu/chips.py through
bench/common/tpu_slices.py, each with its source) applied to the program XLA would be handed.

    python bench/project_tpu.py --tpu v4-8 --model gpt2_2b
    python bench/project_tpu.py --tpu v4-8 --model gpt2_125m
    python bench/project_tpu.py --tpu v4-8 --all          # both tables
    [--batch 32 --seq 1024 --no-grad-ckpt --hlo-dir DIR (keep / reuse traces)]

The recipe (the blog's): per-device batch 32 x 1024 tokens, bf16 compute, fp32
master parameters, auto-wrap on GPT2Block, FULL_SHARD, gradient checkpointing
on every block (configs/fsdp/gpt2_xla_fsdp.json has "xla_fsdp_grad_ckpt": true;
without it 32 x 1024 per chip of the 2B model does not fit a v4's 32 GiB),
eager attention. Four configurations, each traced at the slice's real world
size with real shapes by bench/tpu_trace.py (lazily: no activation is ever
allocated, the model is built on the meta device): xla_fsdp with prefetch off
(forward_prefetch=False, backward_prefetch=None), xla_fsdp with its defaults
(prefetch on), torch_xla FSDPv1 (its defaults, compute_dtype bf16), and
torch_xla FSDPv2 (the per-device program after SPMD partitioning, bf16 autocast).

Cost model, per instruction of the entry computation (before XLA's fusion):
  - dot: max(FLOPs / peak, bytes / HBM bandwidth), bytes = operands + result.
    bf16 dots at the bf16 peak; f32 dots at DEFAULT precision also at the bf16
    peak (TPUs run them as one bf16 pass), at HIGH / HIGHEST 3x / 6x slower.
  - reshape, transpose, bitcast: free views (layout assignment folds them into
    their neighbours on TPU); the rules below look through them.
  - elementwise, reduce, convert, broadcast, slice, layer norm ("fusible"):
    assumed fused with their fusible neighbours, so an op is charged only for
    HBM traffic across the fusion boundary: the bytes of each operand made by
    a non-fusible op (a read) plus its own result when a non-fusible op uses
    it (a write), at HBM bandwidth. Epilogues XLA would fuse into a matmul
    (bias add) are still charged a read, so this part leans high. A slice
    reads only the bytes it returns.
  - copy, concatenate, pad, sort, reduce-window: operands + result bytes;
    gather, dynamic-slice: 2 x result; scatter, dynamic-update-slice: 2 x the
    update; random bits: the result. parameter / constant / tuple /
    get-tuple-element / bitcast / opt-barrier: free.
  - collectives: latency + ring bytes sent per chip / ICI ring bandwidth;
    all-gather (n-1)/n of the result, reduce-scatter (n-1)/n of the operand,
    all-reduce 2(n-1)/n, all-to-all (n-1)/n, collective-permute all of it.
List scheduling: one compute stream and one collective stream. An op is ready
when all its operands have finished; a free stream starts its ready op that
comes first in program order. Projected step = makespan of forward + backward.
No memory limit is modeled (a real scheduler may start a collective later to
bound live memory), nor launch overheads or the host. The optimizer step is not
in the step time; a bytes-only estimate for AdamW is printed beside it.
Compute-only bound = the compute stream's busy time (the step if
communication were free); exposed communication = step - that bound.
HBM capacity is not checked. FSDPv2's program is traced with placeholder
parameters (see bench/tpu_trace.py): its extra per-parameter slice, `* 1` and
copy cost < 0.01 s here, and at 125M / batch 2 x 128 its collectives matched a
real-parameter trace's but for one (the embedding gradient's all-reduce).
MFU the users' way (xla_fsdp.metrics): 6 x parameters x tokens / step /
chips / peak; gradient checkpointing's recompute is work MFU does not count.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from common import REPO, tpu_slices
from common.hlo_graph import HloGraph, dot_flops, result_bytes

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {"gpt2_2b": "configs/models/gpt2-2b.json", "gpt2_125m": "configs/models/gpt2-125m.json"}
BF16 = {"compute_dtype": "bfloat16"}
CONFIGS = [  # (key, label, engine, engine keywords)
    ("xla_fsdp_off", "xla_fsdp, prefetch off", "xla_fsdp",
     dict(BF16, forward_prefetch=False, backward_prefetch=None)),
    ("xla_fsdp_on", "xla_fsdp, prefetch on (default)", "xla_fsdp", dict(BF16)),
    ("xla_fsdp_rep", "xla_fsdp, embeddings replicated", "xla_fsdp", dict(BF16, root_sharding_strategy="NO_SHARD")),
    ("fsdpv1", "torch_xla FSDPv1 (defaults, bf16)", "torch_xla", dict(BF16)),
    ("fsdpv2", "torch_xla FSDPv2 (partitioned, bf16)", "fsdpv2", {}),
]
# The blog's measurement (PyTorch/XLA + Hugging Face GPT-2 2B, FSDPv1 on a v4-8)
BLOG = {"model": "gpt2_2b", "tpu": "v4-8", "config": "fsdpv1", "step_s": 4.191, "mfu": 0.357}

STRUCTURAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
              "replica-id", "opt-barrier", "add-dependency"}
COLLECTIVES = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}
FULL_BYTES = {"copy", "concatenate", "pad", "reverse", "sort", "reduce-window", "select-and-scatter", "while",
              "call", "conditional", "fusion", "custom-call", "fft", "triangular-solve", "cholesky"}
TWICE_RESULT = {"gather", "dynamic-slice"}
UPDATES = {"scatter", "dynamic-update-slice"}
RANDOM = {"rng-bit-generator", "rng", "rng-get-and-update-state"}
VIEWS = {"reshape", "bitcast", "transpose"}  # layouts: XLA folds them into producers / consumers on TPU


def _fusible(opcode: str) -> bool:
    return not (opcode in STRUCTURAL or opcode in VIEWS or opcode in COLLECTIVES or opcode in FULL_BYTES
                or opcode in TWICE_RESULT or opcode in UPDATES or opcode in RANDOM or opcode in ("dot", "convolution"))


def _through_views(g: HloGraph, users: dict):
    """(producer of an operand, users of a result), both looking through reshape/bitcast/transpose."""
    def source(name):
        while g.instrs[name].opcode in VIEWS and g.instrs[name].operands:
            name = g.instrs[name].operands[0]
        return name

    def real_users(name):
        out, stack = set(), list(users[name])
        while stack:
            u = stack.pop()
            if g.instrs[u].opcode in VIEWS:
                stack.extend(users[u])
            else:
                out.add(u)
        return out
    return source, real_users


def _group_size(attrs: str, world: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = re.search(r"replica_groups=\[\d+,(\d+)\]", attrs)  # iota form [groups,size]<=[...]
    return int(m.group(1)) if m else world


def op_costs(g: HloGraph, rbytes: dict, spec, world: int, free_param_slices: bool = False):
    """name -> (stream, seconds, kind); stream None = free. See the module docstring."""
    costs, users = {}, {n: set(u) for n, u in g.users.items()}
    source, real_users = _through_views(g, users)
    for name, ins in g.instrs.items():
        op, out = ins.opcode, rbytes.get(name, ins.bytes)
        ins_bytes = [rbytes.get(o, g.instrs[o].bytes) for o in dict.fromkeys(ins.operands)]
        if op in STRUCTURAL or op in VIEWS or (op == "custom-call" and 'custom_call_target="Sharding"' in ins.attrs):
            costs[name] = (None, 0.0, "free")
        elif op in COLLECTIVES:
            n = _group_size(ins.attrs, world)
            frac = (n - 1) / n if n > 1 else 0.0
            sent = {"all-gather": frac * out, "reduce-scatter": frac * sum(ins_bytes), "all-reduce": 2 * frac * out,
                    "all-to-all": frac * out, "collective-permute": out}[op]
            costs[name] = ("comm", spec.collective_latency_s + sent / spec.ici_ring_bytes_per_s, op)
        elif op in ("dot", "convolution"):
            passes = 1
            if ins.dtype == "f32":
                low = ins.attrs.lower()
                passes = tpu_slices.F32_PASSES["highest" if "highest" in low else "high" if "high" in low else "default"]
            t_math = dot_flops(g, ins) * passes / spec.peak_bf16_flops
            costs[name] = ("compute", max(t_math, (sum(ins_bytes) + out) / spec.hbm_bytes_per_s), "dot")
        elif _fusible(op):
            moved = sum(min(b, out) if op == "slice" else b  # a slice reads only what it returns
                        for o, b in zip(dict.fromkeys(ins.operands), ins_bytes)
                        if not _fusible(g.instrs[source(o)].opcode) and g.instrs[source(o)].opcode != "constant")
            outside = real_users(name)
            if not outside or any(not _fusible(g.instrs[u].opcode) for u in outside):
                moved += out
            costs[name] = ("compute", moved / spec.hbm_bytes_per_s, "fused") if moved else (None, 0.0, "fused")
        else:
            if op in TWICE_RESULT:
                moved = 2 * out
                if free_param_slices and op == "dynamic-slice" and g.instrs[ins.operands[0]].opcode == "parameter":
                    moved = 0  # the FSDPv2 trace's placeholder slicing (bench/tpu_trace.py), not in a real run
            elif op in UPDATES:
                moved = 2 * sum(ins_bytes[1:])
            elif op in RANDOM:
                moved = out
            else:
                moved = sum(ins_bytes) + out
            costs[name] = ("compute", moved / spec.hbm_bytes_per_s, "memory")
    return costs


def list_schedule(g: HloGraph, costs: dict) -> dict:
    """Makespan of the DAG on one compute and one collective stream (non-delay list scheduling,
    program order as priority)."""
    prio = {n: i for i, n in enumerate(g.order)}
    users = {n: set(u) for n, u in g.users.items()}
    waiting = {n: len(set(ins.operands)) for n, ins in g.instrs.items()}
    ready = {"compute": [], "comm": []}
    running = {"compute": None, "comm": None}
    busy = {"compute": 0.0, "comm": 0.0}
    events, finish = [], {}

    def done(first, t):
        stack = [first]
        while stack:
            n = stack.pop()
            finish[n] = t
            for u in users[n]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    stream, secs, _ = costs[u]
                    if stream is None or secs <= 0:
                        stack.append(u)
                    else:
                        heapq.heappush(ready[stream], (prio[u], u))

    for n in [n for n, w in waiting.items() if w == 0]:  # a snapshot: done() lowers the counts
        stream, secs, _ = costs[n]
        if stream is None or secs <= 0:
            done(n, 0.0)
        else:
            heapq.heappush(ready[stream], (prio[n], n))
    now = 0.0
    while True:
        for stream in ("comm", "compute"):
            if running[stream] is None and ready[stream]:
                _, n = heapq.heappop(ready[stream])
                secs = costs[n][1]
                running[stream] = n
                busy[stream] += secs
                heapq.heappush(events, (now + secs, prio[n], n, stream))
        if not events:
            break
        now, _, n, stream = heapq.heappop(events)
        running[stream] = None
        done(n, now)
    expected = sum(secs for stream, secs, _ in costs.values() if stream == "compute")
    if len(finish) != len(g.instrs) or abs(busy["compute"] - expected) > 1e-9 * max(1.0, expected):
        raise RuntimeError(f"scheduled {len(finish)} of {len(g.instrs)} instructions (a cycle?)")
    return {"makespan": max(finish.values()), "compute": busy["compute"], "comm": busy["comm"]}


def project(text: str, spec, world: int, free_param_slices: bool = False) -> dict:
    g = HloGraph(text)
    costs = op_costs(g, result_bytes(text), spec, world, free_param_slices)
    sched = list_schedule(g, costs)
    by_kind = {}
    for stream, secs, kind in costs.values():
        by_kind[kind] = by_kind.get(kind, 0.0) + secs
    sent = sum(secs - spec.collective_latency_s for s, secs, k in costs.values() if s == "comm")
    return dict(sched, exposed=sched["makespan"] - sched["compute"], by_kind=by_kind,
                ring_gb=sent * spec.ici_ring_bytes_per_s / 1e9,
                dot_tflop=sum(dot_flops(g, i) for i in g.instrs.values()) / 1e12,
                collectives=sum(1 for i in g.instrs.values() if i.opcode in COLLECTIVES))


def trace(model: str, key: str, engine: str, kwargs: dict, world: int, args, hlo_dir: str) -> str:
    path = os.path.join(hlo_dir, f"{model}.{key}.w{world}.b{args.batch}.s{args.seq}"
                                 f"{'' if args.grad_ckpt else '.nockpt'}.hlo")
    if not os.path.exists(path):
        cfg = {"model": os.path.join(REPO, MODELS[model]), "engine": engine, "kwargs": kwargs,
               "batch": args.batch, "seq": args.seq, "grad_ckpt": args.grad_ckpt}
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(world))
        env.pop("XLA_USE_SPMD", None)
        proc = subprocess.run([sys.executable, os.path.join(HERE, "tpu_trace.py"), path + ".tmp", json.dumps(cfg)],
                              env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not os.path.exists(path + ".tmp"):
            raise RuntimeError(f"tracing {model} / {key} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(path + ".tmp", path)
    return open(path).read()


def table(model: str, spec, args, hlo_dir: str) -> None:
    from transformers import GPT2Config

    from xla_fsdp import metrics

    world = spec.chips
    params = metrics.gpt2_num_params(GPT2Config.from_json_file(os.path.join(REPO, MODELS[model])))
    tokens = metrics.tokens_per_step(args.batch * world, args.seq)
    step_flops = metrics.flops_per_step(params, tokens)
    print(f"\nPROJECTION (not a measurement): {model} ({params / 1e9:.3f}B parameters) on TPU {spec.name} "
          f"({world} chips, {spec.topology}); per-chip batch {args.batch} x {args.seq}, global {args.batch * world} "
          f"sequences, bf16 compute, fp32 master parameters, gradient checkpointing "
          f"{'on' if args.grad_ckpt else 'off'}; 6ND = {step_flops / 1e15:.3g} PFLOP per step")
    print(f"  chip figures: {spec.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, HBM {spec.hbm_bytes_per_s / 1e9:.0f} GB/s, "
          f"ICI ring {spec.ici_ring_bytes_per_s / 1e9:.0f} GB/s per chip ({spec.ring_links} links x "
          f"{spec.ici_link_one_way / 1e9:.0f} GB/s one way), {spec.collective_latency_s * 1e6:.0f} us per collective")
    print(f"  sources: {spec.sources}")
    print("  (every time and MFU below is a projection; ring GB and matmul TFLOP are counted in the traced program)")
    head = (f"  {'configuration':38s} {'proj. step s':>12s} {'proj. MFU %':>11s} {'exposed comm s':>14s} "
            f"{'compute-only s':>14s} {'link busy s':>11s} {'ring GB/chip':>12s} {'matmul TFLOP':>12s} {'wall s':>7s}")
    print(head)
    rows = {}
    for key, label, engine, kwargs in CONFIGS:
        if args.configs and key not in args.configs:
            continue
        t0 = time.time()
        text = trace(model, key, engine, kwargs, world, args, hlo_dir)
        r = project(text, spec, world, free_param_slices=(engine == "fsdpv2"))
        r["mfu"] = metrics.mfu(step_flops, r["makespan"], world, spec.peak_bf16_flops)
        rows[key] = r
        print(f"  {label:38s} {r['makespan']:12.3f} {100 * r['mfu']:11.1f} {r['exposed']:14.3f} {r['compute']:14.3f} "
              f"{r['comm']:11.3f} {r['ring_gb']:12.2f} {r['dot_tflop']:12.1f} {time.time() - t0:7.0f}")
    if rows:
        any_row = next(iter(rows.values()))
        k = any_row["by_kind"]
        print(f"  compute-only split (first row): matmuls {k.get('dot', 0):.3f} s, fused elementwise traffic "
              f"{k.get('fused', 0):.3f} s, copies/gathers/pads/RNG {k.get('memory', 0):.3f} s")
        shard = params / world
        print(f"  not in the step: optimizer; AdamW on the fp32 shard, bytes only (28 B/parameter): "
              f"{28 * shard / spec.hbm_bytes_per_s:.3f} s (projection)")
    blog_recipe = args.batch == 32 and args.seq == 1024 and args.grad_ckpt
    if model == BLOG["model"] and spec.name == BLOG["tpu"] and BLOG["config"] in rows and blog_recipe:
        r = rows[BLOG["config"]]
        at_blog = metrics.mfu(step_flops, BLOG["step_s"], world, spec.peak_bf16_flops)
        print(f"  check against the blog (measured, FSDPv1, 2B, v4-8): {BLOG['step_s']:.3f} s/step, "
              f"{100 * BLOG['mfu']:.1f}% MFU ({100 * at_blog:.1f}% with {args.batch * world} x {args.seq} tokens and "
              f"our parameter count). Our FSDPv1 projection: {r['makespan']:.3f} s, {100 * r['mfu']:.1f}% = "
              f"{r['makespan'] / BLOG['step_s']:.2f}x the measured step time.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tpu", default="v4-8", help=f"one of {', '.join(sorted(tpu_slices.SLICES))}")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2_2b")
    ap.add_argument("--all", action="store_true", help="both models")
    ap.add_argument("--batch", type=int, default=32, help="per chip")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    ap.add_argument("--configs", type=lambda s: s.split(","), default=None,
                    help=f"subset of {','.join(c[0] for c in CONFIGS)}")
    ap.add_argument("--hlo-dir", default=None, help="keep the traced programs here and reuse them")
    ap.add_argument("--ring-links", type=int, default=None,
                    help="ICI links a chip sends on in a ring collective (default 2; a sensitivity knob)")
    args = ap.parse_args(argv)
    spec = tpu_slices.get(args.tpu)
    if args.ring_links:
        import dataclasses

        spec = dataclasses.replace(spec, ring_links=args.ring_links)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        hlo_dir = args.hlo_dir or tmp
        os.makedirs(hlo_dir, exist_ok=True)
        for model in (["gpt2_2b", "gpt2_125m"] if args.all else [args.model]):
            table(model, spec, args, hlo_dir)
    print(f"\n(all figures above are projections from published chip specifications, not measurements; "
          f"wall time {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
