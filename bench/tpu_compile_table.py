"""Compile every shipped training program for TPU slices with libtpu and print one table.

    python bench/tpu_compile_table.py [--model tiny|2b] [--tpu v4-8 v5e-8] [--cases NAME ...] [--json OUT]

Each row is one case of bench/common/aot_cases.py (runtime x sharding strategy x
feature) checked with `python -m xla_fsdp.aot` for one slice: whether it
compiles, the peak HBM per chip from the compiler, and the collectives of
the TPU-optimized program (synchronous / asynchronous, and the share of the
collective bytes that run asynchronously with a matmul beside them). Every
figure is measured on the TPU-compiled program (libtpu 0.0.21, deviceless).
--model 2b uses the blog's GPT-2 2B at 32 x 1024 tokens per chip with
Adafactor and per-layer checkpointing (each compile takes about 3 minutes here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

from common import aot_cases as ac
from xla_fsdp.tpu import topology

MODELS = {
    "tiny": dict(model=ac.TINY, batch=2, block=64, extra=()),
    "2b": dict(model=os.path.join(ac.ROOT, "configs", "models", "gpt2-2b.json"), batch=32, block=1024,
               extra=("--optim", "adafactor")),
}
CHIPS = {tpu: topology.parse_accelerator_type(tpu).chips for tpu in ("v4-8", "v5e-8", "v6e-8", "v5p-8")}


def run(case_name: str, tpu: str, model: str) -> dict:
    case, m = ac.BY_NAME[case_name], MODELS[model]
    if model == "2b":  # the blog's recipe checkpoints every block (xla_fsdp_grad_ckpt)
        case = dataclasses.replace(case, top={**case.top, "xla_fsdp_grad_ckpt": True})
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ac.command(case, CHIPS[tpu], os.path.join(tmp, "fsdp.json"), os.path.join(tmp, "out"),
                         model=m["model"], batch=m["batch"], block=m["block"]) + list(m["extra"])
        started = time.time()
        got = ac.check(tpu, cmd, runtime=case.runtime, timeout=3600)
    r = got["report"] or {}
    row = {"case": case_name, "tpu": tpu, "model": model, "seconds": round(time.time() - started, 1),
           "compiles": bool(r.get("compiles")), "rc": got["rc"]}
    if r.get("compiles"):
        c = r["collectives"]
        row.update(peak_gib=r["memory"]["peak"] / 2 ** 30, fits=r["fits"], sync=c["sync"], asynchronous=c["async"],
                   gb=c["bytes"] / 1e9, overlapped=c["async_bytes_with_matmul_fraction"])
    elif r.get("does_not_fit"):
        need = r["does_not_fit"]
        row["error"] = (f"does not fit: {need['needed'] / 2 ** 30:.2f} GiB needed, {need['usable'] / 2 ** 30:.2f} "
                        "GiB usable per chip (the compiler's count)")
    else:
        row["error"] = (r.get("error") or got["output"])[:300]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--tpu", nargs="+", default=["v4-8", "v5e-8"])
    p.add_argument("--cases", nargs="+", default=[c.name for c in ac.MATRIX])
    p.add_argument("--json", help="also write the rows to this file")
    opts = p.parse_args(argv)
    rows = []
    print(f"{'case':<24}{'tpu':<8}{'compiles':>9}{'peak GiB':>10}{'sync':>6}{'async':>7}{'GB/step':>9}"
          f"{'async+mm':>9}{'s':>7}", flush=True)
    for name in opts.cases:
        for tpu in opts.tpu:
            row = run(name, tpu, opts.model)
            rows.append(row)
            if row["compiles"]:
                print(f"{name:<24}{tpu:<8}{'yes':>9}{row['peak_gib']:>10.3f}{row['sync']:>6}{row['asynchronous']:>7}"
                      f"{row['gb']:>9.3f}{row['overlapped']:>9.2f}{row['seconds']:>7.0f}", flush=True)
            else:
                print(f"{name:<24}{tpu:<8}{'NO':>9}  {row['error'].splitlines()[-1][:80] if row['error'] else ''}",
                      flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["compiles"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
