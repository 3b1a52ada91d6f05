"""Llama on a TPU slice, compiled: run_clm's Llama step at a chosen depth, traced on this host
and compiled by libtpu 0.0.21 for the slice, with its projected tokens/s/chip beside MaxText's
published rate.

    python bench/llama_tpu.py [--config configs/models/llama3-8b.json] [--tpu v6e-256]
                              [--batch 4] [--seq 8192] [--layers 1 2 32] [--attn pallas] [--json OUT]

Each `--layers N` compiles the config with its first N decoder layers (a copy with
num_hidden_layers=N; the config's own depth compiles the file itself), under run_clm's single
controller with configs/fsdp/llama_xla_fsdp.json (per-layer wrapping and checkpointing by
LlamaDecoderLayer), bf16 compute, `--batch` sequences of `--seq` tokens per chip. The full
model's step is the compiled full-depth row when there is one, else the line through the two
shallowest rows (step(L) = step(a) + (L - a) x slope), and the table says which.

Step times are PROJECTIONS (xla_fsdp.tpu.step_time), calibrated by the one measured point the
model is fitted on (the blog's FSDPv1 2B step on v4-8); no v6e step calibrates them. MFU
counts MaxText's FLOPs per token (xla_fsdp.metrics: 6 x matmul parameters + the attention
term, causal not halved), as its published v6e-256 figure does. Nothing ran on a TPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from common import aot_cases as ac

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FSDP_CONFIG = os.path.join(ROOT, "configs", "fsdp", "llama_xla_fsdp.json")
# measured anchors: (config file, slice, sequences per chip, sequence) -> (tokens/s/chip, MFU, source)
MEASURED = {
    ("llama3-8b.json", "v6e-256", 4, 8192): (
        7207, 0.4546, "MaxText, measured (AI-Hypercomputer/tpu-recipes, Llama 3.1 8B on v6e-256)"),
}
# MaxText's measured rates for a job of the same model, slice and sequence at its own batch (issue 84's
# table: tpu-recipes' Trillium Llama 3.1 70B and 405B, MaxText's README for Llama 2 70B on v5p-512):
# (config file, slice, sequence) -> (tokens/s/chip, MFU as MaxText counts it, source)
MEASURED_ANY_BATCH = {
    ("llama3-70b.json", "v6e-256", 8192): (960, 0.5033, "MaxText, measured (Llama 3.1 70B on v6e-256, its batch)"),
    ("llama3-405b.json", "v6e-256", 8192): (123, 0.3855, "MaxText, measured (Llama 3.1 405B on v6e-256, its batch)"),
    ("llama2-70b.json", "v5p-512", 4096): (692, 0.654, "MaxText, measured (Llama 2 70B on v5p-512, its batch)"),
}
# published MFU of a comparable job where its batch and model differ from ours: printed beside, not matched
PUBLISHED_MFU = {
    ("llama3-70b.json", "v5p-512"): (0.654, "MaxText's README: Llama 2 70B on v5p-512, 65.4% MFU (its batch and "
                                            "sequence, and Llama 2, not this job's)"),
}


def command(config: str, batch: int, seq: int, attn: str, out: str, fsdp_config: str = FSDP_CONFIG,
            optim: str = "", fused_loss: bool = False) -> list:
    """run_clm as the docs run the Llama job (docs/performance.md, Llama 3 8B on v6e-256)."""
    return [ac.RUN_CLM, "--config_name", config, "--fsdp", "full_shard", "--fsdp_config", fsdp_config,
            "--per_device_train_batch_size", str(batch), "--block_size", str(seq), "--output_dir", out,
            "--do_train"] + (["--attn_implementation", attn] if attn else []) + (["--optim", optim] if optim else []) \
        + (["--fused_loss"] if fused_loss else [])


def with_layers(config: str, layers: int, folder: str) -> str:
    """`config` itself at its own depth, else a copy in `folder` with `layers` decoder layers."""
    with open(config) as f:
        cfg = json.load(f)
    if layers == cfg["num_hidden_layers"]:
        return config
    if not 0 < layers < cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: {os.path.basename(config)} has {cfg['num_hidden_layers']} "
                         f"decoder layers; pick 1 to {cfg['num_hidden_layers']}")
    cfg["num_hidden_layers"] = layers
    path = os.path.join(folder, f"layers{layers}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def run(config: str, tpu: str, layers: int, batch: int, seq: int, attn: str, timeout: float,
        fsdp_config: str = FSDP_CONFIG, optim: str = "", fused_loss: bool = False, more_flags: str = "") -> dict:
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = command(with_layers(config, layers, tmp), batch, seq, attn, os.path.join(tmp, "out"), fsdp_config,
                      optim, fused_loss)
        extra = []
        if more_flags:  # on top of the flags xla_fsdp sets for the single controller on this slice
            from xla_fsdp.tpu import libtpu_flags, topology
            from xla_fsdp.tpu.compile_options import parse_libtpu_init_args as parse

            chips = topology.parse_accelerator_type(tpu).chips
            merged = dict(parse(libtpu_flags.for_runtime("single_controller", chips)))
            merged.update(parse(more_flags))  # a flag given here replaces xla_fsdp's value
            extra = ["--libtpu-flags", libtpu_flags.init_args(merged)]
        got = ac.check(tpu, cmd, runtime="auto", timeout=timeout, extra=extra)
    r = got["report"] or {}
    row = {"config": os.path.basename(config), "layers": layers, "batch_per_chip": batch, "seq": seq, "tpu": tpu,
           "attn": attn or "transformers' default", "fused_loss": fused_loss, "more_flags": more_flags,
           "compiles": bool(r.get("compiles")),
           "fits": bool(r.get("fits")), "seconds": round(time.time() - started, 1),
           "fsdp_config": os.path.basename(fsdp_config), "trace_s": r.get("trace_seconds"),
           "compile_s": r.get("compile_seconds"), "compile_stages": r.get("compile_stages"),
           "libtpu_flags": r.get("libtpu_flags"), "error": "", "optim": optim or "run_clm's default (adamw)",
           "recompute": r.get("recompute")}
    if r.get("compiles"):
        p, c = r["projection"], r["collectives"]
        # with host moves, the step they leave the core ([Note: host transfers in libtpu's program])
        host = r.get("host_transfers") or {}
        step, at_peak = host.get("projected_seconds", p["projected_seconds"]), p.get("projected_seconds_kernels_at_peak")
        if at_peak and "exposed_seconds" in host:  # the host moves' wait as at 50% (an estimate)
            at_peak = max(at_peak + host["exposed_seconds"], host["pcie_seconds"])
        row.update(peak_gib=r["memory"]["peak"] / 2 ** 30, projected_s=step, projected_s_kernels_at_peak=at_peak,
                   sync=c["sync"], sent_gb=c["sent_per_chip"] / 1e9, host=r.get("host_transfers"))
    else:
        row["error"] = ((r.get("error") or got["output"]).strip() or f"exit {got['rc']}")[-600:]
    return row


def full_step(rows: list, depth: int, key: str = "projected_s") -> tuple:
    """(the full model's projected step, how it was had): the compiled full-depth row, else the
    line through the two shallowest compiled rows; (None, why) without them."""
    ok = sorted((r for r in rows if r.get(key)), key=lambda r: r["layers"])
    full = [r for r in ok if r["layers"] == depth]
    if full:
        return full[0][key], f"compiled at full depth ({depth} layers)"
    if len(ok) < 2:
        return None, "needs the full depth or two shallower depths compiled"
    a, b = ok[0], ok[1]
    slope = (b[key] - a[key]) / (b["layers"] - a["layers"])
    return a[key] + (depth - a["layers"]) * slope, (
        f"EXTRAPOLATED linearly from {a['layers']} and {b['layers']} layers")


def render(rows: list, config: str) -> str:
    from transformers import AutoConfig

    from xla_fsdp import metrics
    from xla_fsdp.tpu import step_time, topology

    cfg = AutoConfig.from_pretrained(config)
    out = [f"{'layers':>6}{'batch x seq':>14}{'fits':>6}{'peak GiB':>10}{'sync':>6}{'sent GB':>9}"
           f"{'proj s':>9}{'@100% s':>9}{'compile s':>11}"]
    for r in sorted(rows, key=lambda r: r["layers"]):
        head = f"{r['layers']:>6}{str(r['batch_per_chip']) + ' x ' + str(r['seq']):>14}"
        if not r["compiles"]:
            out.append(head + f"    NO  {r['error'].strip().splitlines()[-1][:160] if r['error'].strip() else ''}")
            continue
        at_peak = r.get("projected_s_kernels_at_peak")
        out.append(head + f"{'yes' if r['fits'] else 'NO':>6}{r['peak_gib']:>10.2f}{r['sync']:>6}"
                          f"{r['sent_gb']:>9.2f}{r['projected_s']:>9.3f}"
                          f"{(f'{at_peak:.3f}' if at_peak else '-'):>9}{r['seconds']:>11.0f}")
    if not rows:
        return "\n".join(out)
    r0 = rows[0]
    spec = topology.parse_accelerator_type(r0["tpu"])
    depth = cfg.num_hidden_layers
    tokens = r0["batch_per_chip"] * r0["seq"]
    per_token = metrics.flops_per_step(metrics.matmul_params(cfg), 1, n_layer=depth,
                                       n_embd=metrics.attention_width(cfg), seq_len=r0["seq"], include_attention=True)
    ratio = step_time.CALIBRATION_RATIO
    out.append(f"full model ({depth} layers), {r0['tpu']}, {tokens} tokens per chip, {per_token / 1e9:.1f} GFLOP per "
               f"token (MaxText's count); calibrated x{ratio:.3f} ({step_time.CALIBRATION_SOURCE}):")
    for key, label in (("projected_s", "kernels at 50% of MXU peak"), ("projected_s_kernels_at_peak",
                                                                      "kernels at 100%")):
        step, how = full_step(rows, depth, key)
        if step is None:
            out.append(f"  {label}: {how}")
            continue
        cal = step * ratio
        mfu = metrics.mfu(per_token * tokens, cal, 1, spec.chip.peak_bf16_flops)
        out.append(f"  {label}: PROJECTED {step:.3f} s, calibrated {cal:.3f} s: {tokens / cal:,.0f} tokens/s/chip, "
                   f"MFU {100 * mfu:.1f}% ({how})")
    anchor = MEASURED.get((os.path.basename(config), r0["tpu"], r0["batch_per_chip"], r0["seq"])) or \
        MEASURED_ANY_BATCH.get((os.path.basename(config), r0["tpu"], r0["seq"]))
    if anchor:
        out.append(f"  {anchor[2]}: {anchor[0]:,} tokens/s/chip, MFU {100 * anchor[1]:.2f}%")
    published = PUBLISHED_MFU.get((os.path.basename(config), r0["tpu"]))
    if published:
        out.append(f"  beside: {published[1]} ({100 * published[0]:.1f}%)")
    gen = spec.chip.generation
    out.append("every step time is a PROJECTION from the TPU-compiled program (libtpu 0.0.21, deviceless); "
               + (f"no {gen} step calibrates the model (its one calibration point is a v4 step)" if gen != "v4"
                  else "calibrated by a v4 step"))
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "models", "llama3-8b.json"))
    p.add_argument("--tpu", default="v6e-256")
    p.add_argument("--batch", type=int, default=4, help="sequences per chip")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="decoder layers to compile, each a row")
    p.add_argument("--attn", default="pallas", help="run_clm --attn_implementation ('' for transformers' own)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one compile")
    p.add_argument("--fsdp_config", default=FSDP_CONFIG,
                   help="run_clm's --fsdp_config (default configs/fsdp/llama_xla_fsdp.json; e.g. "
                        "configs/fsdp/llama_xla_fsdp_v2_scan.json for the GSPMD engine with scan_layers)")
    p.add_argument("--optim", default="", help="run_clm's --optim (default: run_clm's, AdamW; e.g. adafactor)")
    p.add_argument("--fused_loss", action="store_true", help="run_clm --fused_loss ([Note: fused output loss])")
    p.add_argument("--libtpu_flags", default="",
                   help="libtpu flags on top of those xla_fsdp sets on the slice (one named here replaces its value)")
    p.add_argument("--json", help="write the rows here (rows already in it are kept and not re-run)")
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    doc = json.load(open(opts.json)) if opts.json and os.path.exists(opts.json) else {"rows": []}
    attn = opts.attn or "transformers' default"
    name = os.path.basename(opts.config)
    doc.setdefault("what", f"{name}, {opts.tpu}, {opts.batch} x {opts.seq} tokens per chip, attention "
                           f"{opts.attn or 'transformers default'}, run_clm single controller with "
                           f"configs/fsdp/{os.path.basename(opts.fsdp_config)}; libtpu 0.0.21 deviceless; "
                           f"projections uncalibrated; "
                           f"written by bench/llama_tpu.py")

    def mine(r):
        return (r.get("config", "llama3-8b.json"), r["tpu"], r["batch_per_chip"], r["seq"], r["attn"],
                r.get("fused_loss", False), r.get("fsdp_config", "llama_xla_fsdp.json"),
                r.get("optim", "run_clm's default (adamw)"), r.get("more_flags", "")) == (
                    name, opts.tpu, opts.batch, opts.seq, attn, opts.fused_loss, os.path.basename(opts.fsdp_config),
                    opts.optim or "run_clm's default (adamw)", opts.libtpu_flags)

    with open(opts.config) as f:
        depth = json.load(f)["num_hidden_layers"]
    bad = [n for n in opts.layers if not 0 < n <= depth]
    if bad:
        raise SystemExit(f"--layers {bad}: {name} has {depth} decoder layers; pick from 1 to {depth}")
    for layers in opts.layers:
        if any(mine(r) and r["layers"] == layers for r in doc["rows"]):
            continue
        row = run(opts.config, opts.tpu, layers, opts.batch, opts.seq, opts.attn, opts.timeout, opts.fsdp_config,
                  opts.optim, opts.fused_loss, opts.libtpu_flags)
        doc["rows"].append(row)
        print(f"{layers} layers: {'compiles' if row['compiles'] else 'NO'} in {row['seconds']} s", flush=True)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(doc, f, indent=1)
    print(render([r for r in doc["rows"] if mine(r)], opts.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
