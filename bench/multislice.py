"""Multislice rows: run_clm's shipped GPT-2 recipe checked for one slice and for several of the
same type (`python -m xla_fsdp.aot --num_slices S`), side by side, in one run.

Each row is the check's report of the job as users launch it (`xla_spawn --num_cores 4
launch/run_clm.py ... --fsdp_config configs/fsdp/gpt2_xla_fsdp.json --optim adafactor`): peak HBM
per chip, the PROJECTED step on the ICI alone, the DCN bytes per chip and the share of them with
compute scheduled beside them, and the PROJECTED step with the DCN lane (docs/pods.md, "Multislice";
[Note: DCN transfers in libtpu's program]). `ratio` is the single slice's step over this row's: the
per-chip throughput (and MFU, the model and per-chip batch being the same) relative to one slice.
Every figure comes from libtpu 0.0.21's deviceless compile on this host; no TPU ran.

    python bench/multislice.py [--models 125m 2b] [--tpu v4-8] [--slices 2] [--out FILE]
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
BATCH = {"125m": 8, "2b": 32}  # sequences of 1024 per chip: the docs' 125M step, the blog's 2B


def command(model: str, tpu: str, slices: int, out: str) -> list:
    return [sys.executable, "-m", "xla_fsdp.aot", "--tpu", tpu, "--num_slices", str(slices), "--json", "--",
            os.path.join("launch", "xla_spawn.py"), "--num_cores", "4", os.path.join("launch", "run_clm.py"),
            "--config_name", os.path.join("configs", "models", f"gpt2-{model}.json"),
            "--per_device_train_batch_size", str(BATCH[model]), "--block_size", "1024", "--optim", "adafactor",
            "--fsdp", "full_shard", "--fsdp_config", os.path.join("configs", "fsdp", "gpt2_xla_fsdp.json"),
            "--output_dir", out, "--overwrite_output_dir", "--do_train"]


def row(model: str, tpu: str, slices: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = command(model, tpu, slices, out)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout)
    p, c, d = r["projection"], r["collectives"], r.get("dcn") or {}
    return {"model": model, "tpu": tpu, "slices": slices, "command": " ".join(cmd[1:]),
            "peak_gib": r["memory"]["peak"] / 2 ** 30, "ici_step_s": p["projected_seconds"],
            "ici_async_fraction": c["async_bytes_fraction"], "dcn_bytes_per_chip": d.get("bytes_per_chip", 0),
            "dcn_types": sorted(d.get("by_type", {})), "dcn_beside_compute": d.get("beside_compute_fraction"),
            "dcn_gbps_per_chip": d.get("dcn_bytes_per_s", 0) * 8 / 1e9,
            "step_s": d.get("projected_seconds", p["projected_seconds"]), "fit_kept": (r.get("fit") or {}).get("count")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["125m", "2b"], choices=sorted(BATCH))
    ap.add_argument("--tpu", default="v4-8")
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  f"multislice_{datetime.date.today().isoformat()}.json"))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'model':<6}{'slices':>7}{'peak GiB':>10}{'ICI step s':>12}{'DCN MB/chip':>13}{'beside':>8}"
          f"{'step s':>9}{'ratio':>7}   (PROJECTED, libtpu 0.0.21 deviceless)")
    for model in args.models:
        one = row(model, args.tpu, 1)
        many = row(model, args.tpu, args.slices)
        for r in (one, many):
            r["ratio"] = one["step_s"] / r["step_s"]
            rows.append(r)
            beside = "" if r["dcn_beside_compute"] is None else f"{100 * r['dcn_beside_compute']:.0f}%"
            print(f"{model:<6}{r['slices']:>7}{r['peak_gib']:>10.2f}{r['ici_step_s']:>12.3f}"
                  f"{r['dcn_bytes_per_chip'] / 1e6:>13.1f}{beside:>8}{r['step_s']:>9.3f}{r['ratio']:>7.3f}")
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "rows": rows}, f, indent=1)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
