"""Our engines against torch_xla's FSDPv1 and FSDPv2, measured on the TPU-optimized program.

    python bench/tpu_perf_table.py [--models 125m 2b] [--tpu v4-8 v5e-8 v6e-8]
                                   [--engines default per_chip gspmd fsdpv1 fsdpv2] [--json OUT]
                                   [--attn eager] [--loss transformers]

Every row is one training step (GPT-2 from configs/models/, sequence 1024,
Adafactor, per-layer checkpointing, bf16 compute) traced on this host and
compiled with libtpu 0.0.21 for the slice (`python -m xla_fsdp.aot`), under
the libtpu flags xla_fsdp sets on a TPU (`xla_fsdp.tpu.libtpu_flags`) for
every engine, anchors included. Columns, all read off the compiled program:
- peak HBM per chip (the compiler's memory statistics);
- GB each chip sends per step on a ring of its replica group, against the
  ideal FULL_SHARD traffic 3 x (N-1)/N x P x 2 bytes (two bf16 gathers and
  one bf16 reduce-scatter of every parameter) and by kind;
- the fraction of those bytes sent by asynchronous collectives with a
  matmul scheduled between start and done ("async+mm"), with any compute
  fusion there ("+cmp"), and the count of synchronous collectives;
- a PROJECTED step time (`xla_fsdp.tpu.step_time`: roofline compute on the
  compiler's schedule, ICI-costed collectives), uncalibrated and calibrated
  by the ratio of the blog's measured FSDPv1 2B v4-8 step (4.191 s) to our
  projection of that same program (FSDPv1 with eager attention) when it is
  in the table, else by step_time's constant from that program; then projected
  MFU as the blog computes it (6 x tokens x params / step / chips / peak).
Nothing here ran on a TPU. 2B compiles take about 3 minutes each here.
Engines: default = launch/run_clm.py with configs/fsdp/gpt2_xla_fsdp.json as
xla_spawn runs it on a single-host TPU (the single controller: gathers and
reduce-scatters as rings of neighbour exchanges, libtpu's scheduler budget at
50%: [Note: rings by default on a TPU]); per_chip = the same job one process
per chip (pinned); gspmd = our GSPMD engine (`xla_fsdp_v2`); fsdpv1 / fsdpv2 =
torch_xla's (bench/anchor_job.py); on request gathers = the single controller
with all-gathers and staged reduce-scatters under the 70% budget (the default
until 2026-11-26); prefetch / flat = those with prefetch on / one flat gather
per unit; ring / rings = reduce-scatters / both as rings, at 70%;
rings_budget50 = rings at 50%, named (now the default's collectives and
flags); keepN (N = 1, 2, 4-18) = the default with its last N checkpointed
layers keeping their activations (`checkpoint_all_but_last`); no_ckpt = the
default without per-layer checkpointing (libtpu recomputes what it must to fit).
Every row records the libtpu flags it was compiled with.
`--attn eager` builds GPT-2 with eager attention in every engine, anchors
included (the blog's transformers had only that; the default is
transformers' own choice, sdpa, which torch 2.9 runs in f32 on XLA: [Note:
eager attention on XLA]); each attention gets its own table, and every table
is calibrated by the blog's program, which had eager attention.
`--loss` picks the training loss in every engine, anchors included:
"transformers" (the default, as run_clm's: the model's own head and loss, the
blog's program) or "fused" (run_clm --fused_loss: the output projection and
loss a chunk of tokens at a time, [Note: fused output loss]). Only an FSDPv1
eager row with transformers' loss calibrates.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# the rows are bench/common's (blog_pairs.py and capacity.py compile the same rows); the names
# below are this table's, and its tests read them here
from common.perf_rows import (ATTN_CHOICES, DEFAULT_ATTN, ENGINES, EXTRA, KEEP, LOSSES, MODELS,  # noqa: F401
                              SEQ, SHIPPED, SLICES, TABLE_MODELS, TABLE_SLICES, attn_of, base_model, calibrate,
                              command, config_for, loss_of, param_count, run)


def render(rows: list, calibration_rows: list = ()) -> str:
    """`rows`, one attention; calibrated by `calibrate(calibration_rows or rows)`."""
    from xla_fsdp.tpu import chips

    ratio, source = calibrate(list(calibration_rows) or rows)
    out = [f"{'model':<6}{'tpu':<7}{'engine':<10}{'peak GiB':>9}{'sent GB':>9}{'x ideal':>8}{'async+mm':>9}{'+cmp':>6}"
           f"{'sync':>6}{'proj s':>9}{'calib s':>9}{'MFU*':>7}  by kind (GB sent/chip)"]
    for r in rows:
        head = f"{r['model']:<6}{r['tpu']:<7}{r['engine']:<10}"
        if not r["compiles"]:
            out.append(head + f"  NO: {r.get('error', '')}")
            continue
        chip = chips.CHIPS[r["chip"]]
        calib = r["projected_s"] * ratio
        tokens = r["batch_per_chip"] * SEQ * r["chips"]
        mfu = 6 * tokens * r["params"] / calib / r["chips"] / chip.peak_bf16_flops
        kinds = " ".join(f"{k}={v}" for k, v in r["by_kind"].items())
        out.append(head + f"{r['peak_gib']:>9.2f}{r['sent_gb']:>9.2f}{r['sent_gb'] / r['ideal_gb']:>8.2f}"
                          f"{r['async_fraction']:>9.2f}{r.get('async_compute_fraction') or float('nan'):>6.2f}{r['sync']:>6}{r['projected_s']:>9.3f}{calib:>9.3f}"
                          f"{mfu:>7.1%}  {kinds}" + ("" if r["fits"] else "  (over HBM)"))
    out.append(f"calibration ratio {ratio:.3f}: {source}")
    out.append("every time is a PROJECTION from the TPU-compiled program (libtpu 0.0.21, deviceless), never a "
               "measurement; MFU* = 6 x tokens x params / calibrated step / chips / peak bf16")
    for model in sorted({r["model"] for r in rows}):
        for tpu in sorted({r["tpu"] for r in rows}):
            base = {r["engine"]: r for r in rows if (r["model"], r["tpu"]) == (model, tpu) and r.get("projected_s")}
            if "default" in base:
                vs = ", ".join(f"{a} {base['default']['projected_s'] / base[a]['projected_s']:.2f}x"
                               for a in ("fsdpv1", "fsdpv2") if a in base)
                if vs:
                    out.append(f"{model} {tpu}: default projected step vs {vs}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(TABLE_MODELS), choices=sorted(MODELS))
    p.add_argument("--tpu", nargs="+", default=list(TABLE_SLICES), choices=sorted(SLICES))
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + EXTRA)
    p.add_argument("--json", help="write the rows here (rows already in it are kept and not re-run)")
    p.add_argument("--dump", default="", help="keep each row's traced and TPU-optimized programs under DIR")
    p.add_argument("--attn", default="", choices=ATTN_CHOICES,
                   help="GPT-2's attention in every engine (default: transformers' own, sdpa; eager: the blog's "
                        "transformers, [Note: eager attention on XLA])")
    p.add_argument("--loss", default="transformers", choices=LOSSES,
                   help="the training loss in every engine: transformers (run_clm's default: the model's own head "
                        "and loss, the blog's program) or fused (run_clm --fused_loss, [Note: fused output loss])")
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    rows = json.load(open(opts.json)) if opts.json and os.path.exists(opts.json) else []
    done = {(r["engine"], r["model"], r["tpu"], attn_of(r), loss_of(r)) for r in rows}
    for model in opts.models:
        params = param_count(MODELS[model])
        for tpu in opts.tpu:
            for engine in opts.engines:
                if (engine, model, tpu, opts.attn or DEFAULT_ATTN, opts.loss) in done:
                    continue
                row = run(engine, model, tpu, params, opts.dump, attn=opts.attn, loss=opts.loss)
                rows.append(row)
                print(f"{model} {tpu} {engine}: {'compiles' if row['compiles'] else 'NO'} in {row['seconds']} s",
                      flush=True)
                if opts.json:
                    with open(opts.json, "w") as f:
                        json.dump(rows, f, indent=1)
    # one attention and loss per table: the ratios compare like programs; the calibration is the
    # blog's program's (eager attention, transformers' loss), whichever the table shows
    print(render([r for r in rows if attn_of(r) == (opts.attn or DEFAULT_ATTN) and loss_of(r) == opts.loss], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
