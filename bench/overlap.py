"""How much of a step's communication can hide behind compute, from the traced program at world 8.

Traces (never executes) one forward+backward on 8 XLA:CPU device threads and
reads the dependency graph of the program (bench/common/hlo_graph.py). For each
collective: its bytes (sent per rank on a ring), the matmul FLOPs that are
neither its ancestors nor its descendants (work it can overlap with), and,
for gathers, whether it is hoistable (no matmul before it: the compiler may
move it to the start of the step, holding its buffer all step long).
Summary per configuration: the fraction of gather + reduce-scatter bytes that
have independent work ("overlappable"); its ceiling for this program, 1 minus
the fraction of bytes that every matmul depends on (the step's first gathers:
the embeddings and what block 0's first matmul needs, and any gather before
them in torch_xla's collective token chain; no schedule of this program can
overlap them, and the shallower the model the larger their share); the
fraction that have enough of it to hide behind ("hidden at TPU rates":
independent FLOPs at the chip's bf16
peak take at least the collective's time on the ICI ring, figures of
bench/common/tpu_slices.py, --tpu; a bound, since several collectives may count the
same matmuls), and the number of hoistable gathers.

    python bench/overlap.py [--per-collective] [--tpu v4-8]   # GPT-2 d256 L4 (gpt2_small), world 8
    python bench/overlap.py --hlo-dir DIR   # the traces bench/project_tpu.py --hlo-dir DIR kept
                                            # (GPT-2 125M and 2B at the slice's world size, real
                                            # shapes; --tpu v5e-8 there traces at world 8)

Configurations: xla_fsdp with forward/backward prefetch on (the default; and
with one flat collective per unit, where hoistable gathers count units),
backward prefetch only, none; the root (embeddings, final norm) NO_SHARD with
the blocks FULL_SHARD (the embeddings replicated: their gather leaves the step,
their gradients are all-reduced instead, at the memory of a full copy with its
optimizer state on every device); and torch_xla's FSDPv1 (pinned layouts, its
defaults). Every unit resharded after forward (root included), as in the
issue's baseline measurement.
"""
import argparse
import os
import tempfile

from common import tpu_slices
from common.hlo_graph import HloGraph
from common.hlo_trace import read, trace

WORLD = 8
RESHARD_ALL = {"disable_reshard_on_root": False}
CONFIGS = [
    ("xla_fsdp, prefetch forward + BACKWARD_PRE (default)", "xla_fsdp", dict(RESHARD_ALL)),
    ("xla_fsdp, the same, one flat gather per unit", "xla_fsdp", dict(RESHARD_ALL, flatten_parameters=True)),
    ("xla_fsdp, BACKWARD_POST, no forward prefetch", "xla_fsdp",
     dict(RESHARD_ALL, forward_prefetch=False, backward_prefetch="BACKWARD_POST")),
    ("xla_fsdp, no prefetch", "xla_fsdp", dict(RESHARD_ALL, forward_prefetch=False, backward_prefetch=None)),
    ("xla_fsdp, no prefetch, one flat gather per unit", "xla_fsdp",
     dict(RESHARD_ALL, forward_prefetch=False, backward_prefetch=None, flatten_parameters=True)),
    ("xla_fsdp, embeddings replicated (NO_SHARD root)", "xla_fsdp",
     dict(RESHARD_ALL, root_sharding_strategy="NO_SHARD")),
    ("xla_fsdp, the same, one flat gather per unit", "xla_fsdp",
     dict(RESHARD_ALL, root_sharding_strategy="NO_SHARD", flatten_parameters=True)),
    ("torch_xla FSDPv1", "torch_xla", dict(RESHARD_ALL)),
]


def analyse(text: str, world: int = WORLD, spec: "tpu_slices.TpuSlice" = None) -> dict:
    spec = spec or tpu_slices.get("v4-8")
    g = HloGraph(text)
    rows = []
    for c in g.collectives(("all-gather", "reduce-scatter")):
        rows.append({"op": c.opcode, "bytes": g.comm_bytes(c, world), "independent_flops": g.independent_flops(c.name),
                     "hoistable": c.opcode == "all-gather" and g.hoistable(c.name),
                     "first": g.before_every_matmul(c.name)})
    # torch_xla gathers with all-reduce (pinned layouts): count those too
    for c in g.collectives(("all-reduce",)):
        if c.bytes > 64:  # not the clipping / loss scalars
            rows.append({"op": "all-reduce", "bytes": g.comm_bytes(c, world),
                         "independent_flops": g.independent_flops(c.name), "hoistable": g.hoistable(c.name),
                         "first": g.before_every_matmul(c.name)})
    total = sum(r["bytes"] for r in rows)
    overlappable = sum(r["bytes"] for r in rows if r["independent_flops"] > 0)
    first = sum(r["bytes"] for r in rows if r["first"])
    hidden = sum(r["bytes"] for r in rows if r["independent_flops"] / spec.peak_bf16_flops
                 >= r["bytes"] / spec.ici_ring_bytes_per_s + spec.collective_latency_s)
    return {"rows": rows, "overlappable": overlappable / total if total else 0.0,
            "hidden": hidden / total if total else 0.0, "ceiling": 1.0 - first / total if total else 0.0,
            "hoistable": sum(r["hoistable"] for r in rows if r["op"] != "reduce-scatter"), "flops": g.total_flops}


def _row(label: str, a: dict) -> str:
    gathers = sum(r["op"] != "reduce-scatter" for r in a["rows"])
    scatters = sum(r["op"] == "reduce-scatter" for r in a["rows"])
    return (f"{label:52s} {gathers:>7d} {scatters:>6d} {a['overlappable']:>12.2f} {a['ceiling']:>7.2f} "
            f"{a['hidden']:>15.2f} {a['hoistable']:>9d}")


def _header(first: str = "configuration") -> str:
    return (f"{first:52s} {'gathers':>7s} {'r-scat':>6s} {'overlappable':>12s} {'ceiling':>7s} "
            f"{'hidden at TPU':>15s} {'hoistable':>9s}")


def from_traces(hlo_dir: str, spec) -> None:
    """The explicit-collective programs bench/project_tpu.py traced (file names
    `<model>.<config>.w<world>.b<batch>.s<seq>.hlo`); FSDPv2's partitioned dump is left out."""
    import glob
    import re

    print(f"fractions of gather + reduce-scatter bytes; hidden at {spec.name} rates")
    print(_header("trace (project_tpu.py)"))
    for path in sorted(glob.glob(os.path.join(hlo_dir, "*.hlo"))):
        name = os.path.basename(path)[:-4]
        m = re.search(r"\.w(\d+)\.", name)
        if "fsdpv2" in name or not m:
            continue
        print(_row(name, analyse(open(path).read(), world=int(m.group(1)), spec=spec)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2_small", choices=["gpt2_small", "gpt2"])
    ap.add_argument("--tpu", default="v4-8", help="chip figures for the 'hidden' column (bench/common/tpu_slices.py)")
    ap.add_argument("--per-collective", action="store_true")
    ap.add_argument("--hlo-dir", help="analyse the traces bench/project_tpu.py --hlo-dir kept instead of tracing")
    args = ap.parse_args()
    spec = tpu_slices.get(args.tpu)
    if args.hlo_dir:
        from_traces(args.hlo_dir, spec)
        return
    configs = [{"name": f"c{i}", "model": args.model, "engine": engine, "kwargs": kwargs}
               for i, (_, engine, kwargs) in enumerate(CONFIGS)]
    with tempfile.TemporaryDirectory() as out:
        trace(configs, out, world=WORLD, timeout=3600)
        texts = [read(out, c["name"], WORLD)[0] for c in configs]
    print(f"{args.model}, world {WORLD}, every unit resharded (traced, per rank); fractions of gather + "
          f"reduce-scatter bytes; hidden at {spec.name} rates")
    print(_header())
    for (label, _, _), text in zip(CONFIGS, texts):
        a = analyse(text, spec=spec)
        print(_row(label, a))
        if args.per_collective:
            for r in a["rows"]:
                print(f"    {r['op']:15s} {r['bytes'] / 1e6:9.3f} MB  independent {r['independent_flops'] / 1e9:8.3f} GFLOP"
                      f"{'  hoistable' if r['hoistable'] else ''}{'  every matmul waits for it' if r['first'] else ''}")


if __name__ == "__main__":
    main()
