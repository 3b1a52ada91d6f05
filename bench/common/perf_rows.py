"""One row of the TPU tables (bench/tpu_perf_table.py, bench/blog_pairs.py, bench/capacity.py):
an engine's training step as users launch it, checked for a slice by `python -m xla_fsdp.aot`
(traced here, compiled with libtpu), and the check's report as a row; the calibration every
table's projected times share. bench/tpu_perf_table.py says what each engine and column is.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from xla_fsdp.tpu import libtpu_flags, topology
from xla_fsdp.train.args import ATTN_IMPLEMENTATIONS

from . import REPO as ROOT
from . import aot_cases as ac

MODELS = {m: os.path.join(ROOT, "configs", "models", f"gpt2-{m}.json")
          for m in ("125m", "125m-nodropout", "2b", "2b-nodropout", "16b", "20b", "32b", "64b", "128b",
                    "16b-nodropout", "20b-nodropout", "32b-nodropout", "64b-nodropout", "128b-nodropout")}
# chips of each slice a row can compile for (xla_fsdp.tpu.topology)
SLICES = {tpu: topology.parse_accelerator_type(tpu).chips
          for tpu in ("v4-8", "v5e-8", "v6e-8", "v4-32", "v4-64", "v4-128", "v4-256", "v4-512", "v5e-256")}
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
KEEP = {f"keep{n}": n for n in range(1, 70)}  # up to the 128B pair's 70 blocks, less one
# the default without our per-layer checkpointing: what to recompute is left to libtpu's own
# rematerialization, which recomputes to fit HBM ([Note: the compiler's recompute])
EXTRA = ("gathers", "prefetch", "flat", "ring", "rings", "rings_budget50", "no_ckpt", "recompute_all") + tuple(KEEP)
# engines that compile the shipped config as run_clm runs it, with SETTINGS / TOP applied
SHIPPED_VARIANTS = ("default", "per_chip", "gathers", "ring", "rings", "rings_budget50", "no_ckpt",
                    "recompute_all") + tuple(KEEP)
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
    "recompute_all": {"checkpoint_all_but_last": None},  # the shipped config before "fit"
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
    if engine in SHIPPED_VARIANTS:
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
        if r.get("fit"):  # checkpoint_all_but_last="fit": the count chosen, the step with every unit recomputed
            f, first = r["fit"], r["fit"]["every_unit_recomputed"]
            row["fit"] = {"count": f["count"], "units": f["units"], "saved_per_unit_gib": max(f["saved_per_unit"]) / 2 ** 30,
                          "recomputed_peak_gib": first["memory"]["peak"] / 2 ** 30,
                          "recomputed_projected_s": first["projection"]["projected_seconds"],
                          "recomputed_compute_s": first["projection"]["compute_seconds"]}
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

