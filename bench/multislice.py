"""Multislice rows: a job checked for one slice and for several of the same type (`python -m
xla_fsdp.aot --num_slices S`), side by side, in one run.

Each row is the check's report of the job as users launch it: peak HBM per chip, the PROJECTED
step on the ICI alone, the DCN bytes per chip and the share of them with compute scheduled beside
them, and the PROJECTED step with the DCN lane (docs/pods.md, "Multislice"; [Note: DCN transfers
in libtpu's program]). `ratio` is the single slice's step over this row's: the per-chip throughput
(tokens/s/chip, and MFU, the model and per-chip batch being the same) relative to one slice.
Every figure comes from libtpu 0.0.21's deviceless compile on this host; no TPU ran.

The jobs (issue 82's rows), each with its shipped recipe:
- `125m`, `2b`: GPT-2 on v4-8 through `xla_spawn --num_cores 4`, `gpt2_xla_fsdp.json`, Adafactor,
  8 and 32 sequences of 1024 per chip (the docs' 125M step, the blog's 2B);
- `64b`: the blog's 64B GPT-2 (`gpt2-64b-nodropout.json`) on v4-256, the pods' recipe: the same
  fsdp_config, Adafactor, the Pallas attention kernel, 8 x 1024 per chip;
- `llama3-8b`: Llama 3.1 8B on v6e-256, `llama_xla_fsdp.json`, AdamW, the Pallas kernel,
  4 x 8192 per chip (docs/performance.md's row).

    python bench/multislice.py [--models 125m 2b 64b llama3-8b] [--slices 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join("configs", "fsdp", "gpt2_xla_fsdp.json")
# job -> (slice type, model config, fsdp_config, sequences per chip, sequence, run_clm's extra flags)
JOBS = {
    "125m": ("v4-8", "gpt2-125m.json", GPT2, 8, 1024, ["--optim", "adafactor"]),
    "2b": ("v4-8", "gpt2-2b.json", GPT2, 32, 1024, ["--optim", "adafactor"]),
    "64b": ("v4-256", "gpt2-64b-nodropout.json", GPT2, 8, 1024,
            ["--optim", "adafactor", "--attn_implementation", "pallas"]),
    "llama3-8b": ("v6e-256", "llama3-8b.json", os.path.join("configs", "fsdp", "llama_xla_fsdp.json"), 4, 8192,
                  ["--attn_implementation", "pallas"]),
}


def command(model: str, slices: int, out: str) -> list:
    tpu, config, fsdp_config, batch, seq, extra = JOBS[model]
    spawn = [os.path.join("launch", "xla_spawn.py"), "--num_cores", "4"] if tpu == "v4-8" else []
    return [sys.executable, "-m", "xla_fsdp.aot", "--tpu", tpu, "--num_slices", str(slices), "--json", "--",
            *spawn, os.path.join("launch", "run_clm.py"), "--config_name", os.path.join("configs", "models", config),
            "--per_device_train_batch_size", str(batch), "--block_size", str(seq), *extra,
            "--fsdp", "full_shard", "--fsdp_config", fsdp_config,
            "--output_dir", out, "--overwrite_output_dir", "--do_train"]


def row(model: str, slices: int) -> dict:
    tpu, _, _, batch, seq, _ = JOBS[model]
    with tempfile.TemporaryDirectory() as out:
        cmd = command(model, slices, out)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout)
    p, c, d = r["projection"], r["collectives"], r.get("dcn") or {}
    step = d.get("projected_seconds", p["projected_seconds"])
    return {"model": model, "tpu": tpu, "slices": slices, "command": " ".join(cmd[1:]),
            "peak_gib": r["memory"]["peak"] / 2 ** 30, "ici_step_s": p["projected_seconds"],
            "ici_async_fraction": c["async_bytes_fraction"], "dcn_bytes_per_chip": d.get("bytes_per_chip", 0),
            "dcn_types": sorted(d.get("by_type", {})), "dcn_beside_compute": d.get("beside_compute_fraction"),
            "dcn_in_loops": d.get("in_loops", 0), "dcn_exposed_s": d.get("exposed_seconds", 0.0),
            "dcn_first_send": d.get("first_send_fraction"), "dcn_gbps_per_chip": d.get("dcn_bytes_per_s", 0) * 8 / 1e9,
            "step_s": step, "tokens_per_s_per_chip": batch * seq / step,
            "fit_kept": (r.get("fit") or {}).get("count"), "trace_s": r.get("trace_seconds"),
            "compile_s": r.get("compile_seconds")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["125m", "2b"], choices=sorted(JOBS))
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  f"multislice_{datetime.date.today().isoformat()}.json"))
    args = ap.parse_args(argv)
    rows = []
    if os.path.exists(args.out):  # rows of other jobs already in the file are kept
        with open(args.out) as f:
            rows = [r for r in json.load(f)["rows"] if r["model"] not in args.models]
    print(f"{'model':<10}{'slices':>7}{'peak GiB':>10}{'ICI step s':>12}{'DCN MB/chip':>13}{'beside':>8}"
          f"{'exposed s':>11}{'step s':>9}{'tok/s/chip':>12}{'ratio':>7}   (PROJECTED, libtpu 0.0.21 deviceless)")
    for model in args.models:
        one = row(model, 1)
        many = row(model, args.slices)
        for r in (one, many):
            r["ratio"] = one["step_s"] / r["step_s"]
            rows.append(r)
            beside = "" if r["dcn_beside_compute"] is None else f"{100 * r['dcn_beside_compute']:.0f}%"
            print(f"{model:<10}{r['slices']:>7}{r['peak_gib']:>10.2f}{r['ici_step_s']:>12.3f}"
                  f"{r['dcn_bytes_per_chip'] / 1e6:>13.1f}{beside:>8}{r['dcn_exposed_s']:>11.3f}{r['step_s']:>9.3f}"
                  f"{r['tokens_per_s_per_chip']:>12,.0f}{r['ratio']:>7.3f}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "rows": rows}, f, indent=1)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
