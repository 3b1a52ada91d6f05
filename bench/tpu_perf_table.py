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
import dataclasses
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import aot_cases as ac  # noqa: E402

from xla_fsdp.tpu import libtpu_flags  # noqa: E402
from xla_fsdp.train.args import ATTN_IMPLEMENTATIONS  # noqa: E402

MODELS = {m: os.path.join(ROOT, "configs", "models", f"gpt2-{m}.json")
          for m in ("125m", "125m-nodropout", "2b", "2b-nodropout", "16b", "20b", "32b", "64b", "128b",
                    "16b-nodropout", "20b-nodropout", "32b-nodropout", "64b-nodropout", "128b-nodropout")}
SLICES = {"v4-8": 4, "v5e-8": 8, "v6e-8": 8, "v4-32": 16, "v4-64": 32, "v4-128": 64, "v4-256": 128,
          "v4-512": 256, "v5e-256": 256}
TABLE_MODELS, TABLE_SLICES = ("125m", "2b"), ("v4-8", "v5e-8", "v6e-8")  # the default table
# sequences per chip: the blog's 32 x 1024; v5e's 16 GiB chips take 8
BATCH = {"v4-8": 32, "v5e-8": 8, "v6e-8": 32}
ENGINES = ("default", "per_chip", "gspmd", "fsdpv1", "fsdpv2")
# on request, the single controller with other collectives than the shipped "auto" (rings on a TPU:
# [Note: rings by default on a TPU]): all-gathers and staged reduce-scatters (the default until
# 2026-11-26, and what runs where rings do not apply) / those with prefetch on / one flat gather per
# unit / reduce-scatters alone as rings ([Note: ring reduce-scatter]) / gathers and reduce-scatters
# as rings / the same under a 50% scheduler budget (named before it became the default's)
# the default with its last N checkpointed layers keeping their activations ([Note: checkpoint all but the last])
KEEP = {f"keep{n}": n for n in (1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18)}
# the default without our per-layer checkpointing: what to recompute is left to libtpu's own
# rematerialization, which recomputes to fit HBM ([Note: the compiler's recompute])
EXTRA = ("gathers", "prefetch", "flat", "ring", "rings", "rings_budget50", "no_ckpt") + tuple(KEEP)
TOP = {"no_ckpt": {"xla_fsdp_grad_ckpt": False}}  # top-level fsdp_config keys an engine changes
# xla_fsdp_settings each engine adds to the shipped config (or to its aot case)
SETTINGS = {
    "gathers": {"all_gather_impl": "all_gather"},
    "prefetch": {"all_gather_impl": "all_gather"},
    "flat": {"all_gather_impl": "all_gather"},
    "ring": {"all_gather_impl": "all_gather", "reduce_scatter_stages": "ring"},
    "rings": {"all_gather_impl": "ring", "reduce_scatter_stages": "ring"},
    "rings_budget50": {"all_gather_impl": "ring", "reduce_scatter_stages": "ring"},
    **{engine: {"checkpoint_all_but_last": n} for engine, n in KEEP.items()},
}
# libtpu flags where they are not the ones xla_fsdp sets for the engine's runtime (each row records
# its flags): the single controller's previous collectives under the 70% budget they were measured
# and shipped with; the rings at 70% and, named explicitly, at 50%
FLAGS = {**{e: dict(libtpu_flags.ASYNC_COLLECTIVES) for e in ("gathers", "prefetch", "flat", "ring", "rings")},
         "rings_budget50": dict(libtpu_flags.SINGLE_CONTROLLER_COLLECTIVES)}
SHIPPED = os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp.json")
SEQ = 1024
BLOG_FSDPV1_2B_V4_8_S = 4.191  # the blog's measured step (35.7% MFU), 32 x 1024 per chip
ANCHOR = os.path.join(ROOT, "bench", "anchor_job.py")
DEFAULT_ATTN = "transformers' default"  # a row's "attn" when --attn was not given (sdpa)
ATTN_CHOICES = ("",) + ATTN_IMPLEMENTATIONS  # --attn: "" keeps transformers' own choice


LOSSES = ("transformers", "fused")  # --loss; rows without "loss" were compiled with transformers'


def config_for(model: str, attn: str) -> str:
    """The MODELS key a row of `model` compiles under `attn`: under the Pallas kernel (no attention
    dropout) the same config with attention dropout 0 (configs/models/gpt2-<model>-nodropout.json)."""
    return model if attn != "pallas" or model.endswith("-nodropout") else f"{model}-nodropout"


def base_model(model: str) -> str:
    """The model a MODELS key is a variant of: config_for's inverse ("16b-nodropout" -> "16b")."""
    return model.removesuffix("-nodropout")


def loss_of(row: dict) -> str:
    """A row's training loss (rows written before --loss existed had transformers' head and loss)."""
    return row.get("loss", "transformers")


def attn_of(row: dict) -> str:
    """A row's attention (rows written before --attn existed have none: transformers' default)."""
    return row.get("attn", DEFAULT_ATTN)


def dump_name(model: str, tpu: str, engine: str, attn: str = "", loss: str = "transformers") -> str:
    """The --dump folder of one row: <model>-<tpu>-<engine>, then -<attn> unless it is the default,
    then -fused_loss for the fused loss."""
    return (f"{model}-{tpu}-{engine}" + (f"-{attn}" if attn and attn != DEFAULT_ATTN else "")
            + ("-fused_loss" if loss == "fused" else ""))
LAUNCHER = os.path.join(ROOT, "launch", "xla_spawn.py")


def param_count(config_path: str) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config.from_json_file(config_path))
    return sum(p.numel() for p in model.parameters())  # tied embeddings once


def command(engine: str, model: str, tpu: str, tmp: str, batch: int = 0, attn: str = "",
            loss: str = "transformers") -> tuple[list, str]:
    """(the job's command as users launch it, the runtime to check it in); `batch`: sequences
    per chip (0: the slice's default, BATCH); `attn`: GPT-2's attention in every engine, ours
    and the anchors alike (""; transformers' own choice); `loss`: "fused" or "transformers", in
    every engine alike."""
    batch = batch or BATCH[tpu]
    if engine in ("fsdpv1", "fsdpv2"):
        flag = "--per_chip" if engine == "fsdpv1" else "--spmd"
        return ([LAUNCHER, flag, ANCHOR, "--engine", engine, "--config", MODELS[model], "--batch", str(batch),
                 "--seq", str(SEQ), "--grad_ckpt"] + (["--attn", attn] if attn else [])
                + (["--fused_loss"] if loss == "fused" else []), "auto")
    if engine in ("default", "per_chip", "gathers", "ring", "rings", "rings_budget50", "no_ckpt") + tuple(KEEP):
        config = SHIPPED  # the shipped TPU config, as the README's TPU command runs it
        if engine in SETTINGS or engine in TOP:
            with open(SHIPPED) as f:
                shipped = json.load(f)
            shipped["xla_fsdp_settings"].update(SETTINGS.get(engine, {}))
            shipped.update(TOP.get(engine, {}))
            config = os.path.join(tmp, "fsdp.json")
            with open(config, "w") as f:
                json.dump(shipped, f)
        cmd = [ac.RUN_CLM, "--config_name", MODELS[model], "--fsdp", "full_shard", "--fsdp_config", config,
               "--output_dir", os.path.join(tmp, "out"), "--do_train", "--per_device_train_batch_size",
               str(batch), "--block_size", str(SEQ), "--optim", "adafactor"]
    else:
        case = {"gspmd": ac.BY_NAME["gspmd"], "prefetch": ac.BY_NAME["sc-full_shard"],
                "flat": ac.BY_NAME["sc-flat"]}[engine]
        case = dataclasses.replace(case, top={**case.top, "xla_fsdp_grad_ckpt": True},
                                   settings={**case.settings, **SETTINGS.get(engine, {})})
        cmd = ac.command(case, SLICES[tpu], os.path.join(tmp, "fsdp.json"), os.path.join(tmp, "out"),
                         model=MODELS[model], batch=batch, block=SEQ) + ["--optim", "adafactor"]
    launcher = {"per_chip": [LAUNCHER, "--per_chip"], "gspmd": [LAUNCHER, "--spmd"]}.get(engine, [LAUNCHER])
    return (launcher + cmd + (["--attn_implementation", attn] if attn else [])
            + (["--fused_loss"] if loss == "fused" else []), "auto")


def run(engine: str, model: str, tpu: str, params: int, dump: str = "", batch: int = 0, attn: str = "",
        loss: str = "transformers") -> dict:
    batch = batch or BATCH[tpu]
    with tempfile.TemporaryDirectory() as tmp:
        cmd, runtime = command(engine, model, tpu, tmp, batch, attn, loss)
        started = time.time()
        extra = ["--dump", os.path.join(dump, dump_name(model, tpu, engine, attn, loss))] if dump else []
        if engine in FLAGS:
            extra += ["--libtpu-flags", libtpu_flags.init_args(FLAGS[engine])]
        got = ac.check(tpu, cmd, runtime=runtime, extra=extra, timeout=3600)
    r = got["report"] or {}
    n = SLICES[tpu]
    row = {"engine": engine, "model": model, "tpu": tpu, "chips": n, "batch_per_chip": batch,
           "params": params, "attn": attn or DEFAULT_ATTN, "loss": loss, "seconds": round(time.time() - started, 1), "compiles": bool(r.get("compiles")),
           "runtime": r.get("runtime"), "ideal_gb": 3 * (n - 1) / n * params * 2 / 1e9}
    row["libtpu_flags"] = r.get("libtpu_flags")
    if r.get("compiles"):
        c, p = r["collectives"], r["projection"]
        row.update(fits=r["fits"], peak_gib=r["memory"]["peak"] / 2 ** 30, sent_gb=c["sent_per_chip"] / 1e9,
                   by_kind={k: round(v.get("sent", 0) / 1e9, 3) for k, v in c["by_kind"].items()},
                   async_fraction=c["sent_async_with_matmul_fraction"], sync=c["sync"], asynchronous=c["async"],
                   async_compute_fraction=c.get("sent_async_with_compute_fraction"),
                   projected_s=p["projected_seconds"], compute_s=p["compute_seconds"],
                   flops=p["flops"], chip=p["chip"])
        if p.get("kernel_calls"):  # Pallas kernels, charged at 50% of MXU peak; the step at 100% beside
            row.update(kernel_calls=p["kernel_calls"], kernel_flops=p["kernel_flops"],
                       kernel_mxu_share=p["kernel_mxu_share"],
                       projected_s_kernels_at_peak=p["projected_seconds_kernels_at_peak"])
    elif r.get("does_not_fit"):
        need = r["does_not_fit"]
        row["error"] = f"does not fit: {need['needed'] / 2 ** 30:.2f} GiB needed, {need['usable'] / 2 ** 30:.2f} usable"
    else:
        row["error"] = (r.get("error") or got["output"]).strip().splitlines()[-1][:200] if (
            r.get("error") or got["output"]).strip() else f"exit {got['rc']}"
    again = r.get("without_rings")  # the check's retry with XLA_FSDP_RINGS=0, when the rings did not fit
    if again:
        need = again.get("does_not_fit")
        row["without_rings"] = {"compiles": again["compiles"], "fits": again["fits"],
                                "peak_gib": again["memory"]["peak"] / 2 ** 30 if again.get("memory") else None,
                                "needed_gib": need["needed"] / 2 ** 30 if need else None,
                                "projected_s": (again.get("projection") or {}).get("projected_seconds"),
                                "libtpu_flags": again.get("libtpu_flags")}
    return row


def calibrate(rows: list) -> tuple:
    """(measured / projected, where from) for the blog's FSDPv1 2B v4-8 step: from this table's
    FSDPv1 2B v4-8 row with eager attention (the program the blog ran) when it has one, else
    step_time's constant (the same ratio, from the run that set it). A row with another attention
    (or the fused loss) is not the blog's program and never calibrates."""
    from xla_fsdp.tpu import step_time

    for r in rows:
        if (r["engine"], r["model"], r["tpu"], r.get("attn"), loss_of(r)) == (
                "fsdpv1", "2b", "v4-8", "eager", "transformers") and r.get("projected_s"):
            return (BLOG_FSDPV1_2B_V4_8_S / r["projected_s"],
                    f"blog FSDPv1 2B v4-8 measured {BLOG_FSDPV1_2B_V4_8_S} s / this run's eager-attention "
                    f"FSDPv1 program projected at {r['projected_s']:.3f} s")
    return step_time.CALIBRATION_RATIO, f"{step_time.CALIBRATION_SOURCE} (xla_fsdp.tpu.step_time)"


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
