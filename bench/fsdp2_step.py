"""The FSDP2 example's step (`fully_shard`) beside our engine and torch_xla's FSDPv2, on the TPU's program.

    python bench/fsdp2_step.py [--tpu v4-8] [--preset 1b] [--batch 8] [--seq 2048]
                               [--engines fully_shard xla_fsdp fsdpv2] [--no-ac] [--json OUT] [--dump DIR]

One Llama (examples/fsdp2_llama.py's `Llama`, `--preset`), AdamW, clipping at 1.0,
bf16 compute with float32 gradient reduction, each DecoderLayer recomputed in
backward (unless --no-ac), `--batch` sequences of `--seq` tokens per chip:
- fully_shard: the example itself, `examples/fsdp2_llama.py --bf16
  --activation_checkpointing before` (FSDP2's pattern: per layer, then the root;
  `MixedPrecisionPolicy(bfloat16, float32)`);
- xla_fsdp: `XlaFullyShardedDataParallel` (collective engine, single controller)
  auto-wrapped by DecoderLayer, compute_dtype bf16, fp32_reduce_scatter
  (bench/llama_engine_job.py);
- fsdpv2: torch_xla's SPMD FSDP (bench/llama_engine_job.py), bf16 autocast.
Each is traced on this host and compiled with libtpu 0.0.21 for the slice through
`python -m xla_fsdp.aot` (single controller, the libtpu flags xla_fsdp sets for it).
Columns, read off the TPU-compiled program: peak HBM per chip, GB each chip sends
per step against the ideal (N-1)/N x P x 8 bytes (two bf16 gathers and one float32
reduce-scatter of every parameter), the fraction of those bytes sent asynchronously
with a matmul between start and done (and with any compute), synchronous
collectives, and the PROJECTED step time (xla_fsdp/tpu/step_time.py, calibrated
by its constant). Then fully_shard's step and peak against the best other engine.
Nothing here ran on a TPU: every time is a projection.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from common import aot_cases as ac
from common import examples
from xla_fsdp.tpu import topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLE = os.path.join(ROOT, "examples", "fsdp2_llama.py")
JOB = os.path.join(ROOT, "bench", "llama_engine_job.py")
ENGINES = ("fully_shard", "xla_fsdp", "fsdpv2")
CHIPS = {tpu: topology.parse_accelerator_type(tpu).chips for tpu in ("v4-8", "v5e-8", "v6e-8")}
BYTES_PER_PARAM = 2 + 2 + 4  # bf16 gather in forward, again in backward, float32 reduce-scatter


def param_count(preset: str) -> int:
    import torch

    example = examples.load("fsdp2_llama")
    with torch.device("meta"):
        model = example.Llama(example.PRESETS[preset])
    return sum(p.numel() for p in model.parameters())


def command(engine: str, preset: str, batch: int, seq: int, chips: int, ac_on: bool) -> list:
    if engine == "fully_shard":  # --batch_size is the host's: every chip's share
        return [EXAMPLE, "--preset", preset, "--steps", "2", "--bf16", "--batch_size", str(batch * chips),
                "--seq_len", str(seq), "--activation_checkpointing", "before" if ac_on else "none"]
    return [JOB, "--engine", engine, "--preset", preset, "--batch", str(batch), "--seq", str(seq)] + (
        ["--ac"] if ac_on else [])


def run(engine: str, opts, params: int) -> dict:
    chips = CHIPS[opts.tpu]
    cmd = command(engine, opts.preset, opts.batch, opts.seq, chips, opts.ac)
    extra = ["--dump", os.path.join(opts.dump, engine)] if opts.dump else []
    started = time.time()
    got = ac.check(opts.tpu, cmd, runtime="single_controller", extra=extra, timeout=3600)
    r = got["report"] or {}
    row = {"engine": engine, "tpu": opts.tpu, "chips": chips, "preset": opts.preset, "params": params,
           "batch_per_chip": opts.batch, "seq": opts.seq, "activation_checkpointing": opts.ac,
           "command": "python -m xla_fsdp.aot --tpu {} --runtime single_controller -- {}".format(
               opts.tpu, " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)),
           "seconds": round(time.time() - started, 1), "compiles": bool(r.get("compiles")),
           "libtpu_flags": r.get("libtpu_flags"), "ideal_gb": (chips - 1) / chips * params * BYTES_PER_PARAM / 1e9}
    if r.get("compiles"):
        c, p = r["collectives"], r["projection"]
        row.update(fits=r["fits"], peak_gib=r["memory"]["peak"] / 2 ** 30, memory=r["memory"],
                   compile_seconds=r.get("compile_seconds"), sent_gb=c["sent_per_chip"] / 1e9,
                   by_kind={k: {"sync": v["sync"], "async": v["async"], "gb_sent": round(v.get("sent", 0) / 1e9, 3)}
                            for k, v in c["by_kind"].items()},
                   async_fraction=c["sent_async_with_matmul_fraction"],
                   async_compute_fraction=c.get("sent_async_with_compute_fraction"), sync=c["sync"],
                   asynchronous=c["async"], projected_s=p["projected_seconds"], compute_s=p["compute_seconds"],
                   calibrated_s=p.get("calibrated_seconds"), calibration=p.get("calibration_ratio"))
    else:
        need = r.get("does_not_fit")
        row["error"] = (f"does not fit: {need['needed'] / 2 ** 30:.2f} GiB needed" if need else
                        (r.get("error") or got["output"] or f"exit {got['rc']}").strip()[-600:])
    return row


def render(rows: list) -> str:
    out = [f"{'engine':<12}{'peak GiB':>9}{'sent GB':>9}{'x ideal':>8}{'async+mm':>9}{'+cmp':>6}{'sync':>6}"
           f"{'proj s':>9}{'calib s':>9}  by kind (sync/async, GB sent per chip)"]
    for r in rows:
        if not r["compiles"]:
            out.append(f"{r['engine']:<12}  NO: {r.get('error', '')[-300:]}")
            continue
        kinds = " ".join(f"{k}={v['sync']}/{v['async']},{v['gb_sent']}" for k, v in r["by_kind"].items())
        out.append(f"{r['engine']:<12}{r['peak_gib']:>9.2f}{r['sent_gb']:>9.2f}{r['sent_gb'] / r['ideal_gb']:>8.2f}"
                   f"{r['async_fraction']:>9.2f}{r.get('async_compute_fraction') or float('nan'):>6.2f}{r['sync']:>6}"
                   f"{r['projected_s']:>9.3f}{(r.get('calibrated_s') or float('nan')):>9.3f}  {kinds}"
                   + ("" if r["fits"] else "  (over HBM)"))
    ok = {r["engine"]: r for r in rows if r["compiles"]}
    others = [r for e, r in ok.items() if e != "fully_shard"]
    if "fully_shard" in ok and others:
        best = min(others, key=lambda r: r["projected_s"])
        fs = ok["fully_shard"]
        out.append(f"fully_shard / best engine ({best['engine']}): step {fs['projected_s'] / best['projected_s']:.3f}x "
                   f"(goal <= 1.03), peak HBM {fs['peak_gib']:.2f} against {best['peak_gib']:.2f} GiB "
                   f"(goal: at most)")
    out.append("every time is a PROJECTION from the TPU-compiled program (libtpu 0.0.21, deviceless compile), "
               "never a measurement")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tpu", default="v4-8", choices=sorted(CHIPS))
    p.add_argument("--preset", default="1b")
    p.add_argument("--batch", type=int, default=8, help="sequences per chip")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--no-ac", dest="ac", action="store_false", help="keep every layer's activations")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dump", default="", help="keep each engine's traced and TPU-optimized programs under DIR")
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    params = param_count(opts.preset)
    rows = []
    for engine in opts.engines:
        row = run(engine, opts, params)
        rows.append(row)
        print(f"{engine}: {'compiles' if row['compiles'] else 'NO'} in {row['seconds']} s", flush=True)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "command": "python bench/fsdp2_step.py " + " ".join(argv or sys.argv[1:]),
                           "rows": rows}, f, indent=1)
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
