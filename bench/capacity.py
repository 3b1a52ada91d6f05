"""Memory capacity from the compiler: the largest GPT-2 of the blog's family whose training
step fits each slice, per engine.

    python bench/capacity.py [--tpu v4-8 v4-32 v4-128 v5e-8 v5e-256] [--engines default]
                             [--batch 1] [--attn pallas] [--json OUT]

For each slice and engine the family (configs/models/gpt2-{2b,16b,20b,32b,64b,128b}.json) is
walked upward at `--batch` sequences of 1024 per chip (default 1: the most a slice can train
at all), each step traced on this host and compiled with libtpu 0.0.21 for the slice
(bench/tpu_perf_table.py's rows: Adafactor, per-layer checkpointing, bf16 compute, the libtpu
flags xla_fsdp sets); the walk stops at the first size that does not fit. `--start` skips
sizes already known to fit (e.g. from bench/blog_pairs.py, whose per-chip batches are
larger). `--attn pallas` gives every engine the Pallas flash-attention kernel and compiles each
size's config with attention dropout 0 (gpt2-<size>-nodropout.json; the kernel has none).
Nothing ran on a TPU; "fits" is the compiler's verdict on HBM per chip.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from common import perf_rows as table  # bench/tpu_perf_table.py's rows

FAMILY = ("2b", "16b", "20b", "32b", "64b", "128b")
SLICES = ("v4-8", "v4-32", "v4-128", "v5e-8", "v5e-256")


def size(row: dict) -> str:
    """The family size a row compiled (its config may be the size's twin without attention dropout)."""
    return table.base_model(row["model"])


def render(rows: list) -> str:
    """`rows`, one attention."""
    out = [f"{'slice':<9}{'engine':<9}{'largest that fits':<19}{'peak GiB':>9}   first that does not"]
    for tpu in SLICES:
        for engine in sorted({r["engine"] for r in rows if r["tpu"] == tpu}):
            mine = sorted((r for r in rows if (r["tpu"], r["engine"]) == (tpu, engine)),
                          key=lambda r: FAMILY.index(size(r)))
            fit = [r for r in mine if r["compiles"] and r.get("fits")]
            miss = [r for r in mine if not (r["compiles"] and r.get("fits"))]
            best = fit[-1] if fit else None
            over = miss[0] if miss else None
            out.append(f"{tpu:<9}{engine:<9}{(size(best) + ' at ' + str(best['batch_per_chip']) + 'x1024') if best else '-':<19}"
                       f"{(best['peak_gib'] if best else float('nan')):>9.2f}   "
                       + (f"{size(over)}: {over.get('error', 'over HBM')}" if over else "(not tried above)"))
    out.append("fits = libtpu 0.0.21's compile of the step for the slice succeeded within HBM (deviceless)")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tpu", nargs="+", default=list(SLICES), choices=sorted(table.SLICES))
    p.add_argument("--engines", nargs="+", default=["default"], choices=table.ENGINES)
    p.add_argument("--batch", type=int, default=1, help="sequences of 1024 per chip")
    p.add_argument("--start", default="2b", choices=FAMILY, help="first size to try")
    p.add_argument("--attn", default="", choices=table.ATTN_CHOICES,
                   help="GPT-2's attention in every engine (default: transformers' own, SDPA)")
    p.add_argument("--json", help="write the rows here (rows already in it are kept and not re-run)")
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    rows = json.load(open(opts.json)) if opts.json and os.path.exists(opts.json) else []
    attn = opts.attn or table.DEFAULT_ATTN
    for tpu in opts.tpu:
        for engine in opts.engines:
            for family_size in FAMILY[FAMILY.index(opts.start):]:
                model = table.config_for(family_size, opts.attn)
                row = next((r for r in rows if (r["engine"], r["model"], r["tpu"], table.attn_of(r)) == (
                    engine, model, tpu, attn)), None)
                if row is None:
                    row = table.run(engine, model, tpu, table.param_count(table.MODELS[model]), batch=opts.batch,
                                    attn=opts.attn)
                    rows.append(row)
                    print(f"{tpu} {engine} {model}: {'fits' if row['compiles'] and row.get('fits') else 'NO'} "
                          f"in {row['seconds']} s", flush=True)
                    if opts.json:
                        with open(opts.json, "w") as f:
                            json.dump(rows, f, indent=1)
                if not (row["compiles"] and row.get("fits")):
                    break
    print(render([r for r in rows if table.attn_of(r) == attn]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
