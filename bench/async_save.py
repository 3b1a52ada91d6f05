"""What a checkpoint stalls training for: the save written beside training (CheckpointManager
with async_save=True, run_clm's default) against the save that waits for its files, side by side
in one run, to a local directory and to a local GCS emulator.

GPT-2 small (124M parameters) wrapped by xla_fsdp (one unit per GPT2Block) on the single
controller over 4 XLA:CPU devices, one AdamW step taken (two moments per parameter). Each
round saves the same step both ways, in turn:
  - synchronous: `manager.save` with async_save=False returns when the checkpoint is committed;
    training stalls for all of it;
  - beside training: `manager.save` returns once the shards are copied to host memory (the
    stall); the files are written on a thread while a training step runs; `wait()` then
    commits (written = the time from the save's start to its commit).
The median of the rounds is reported. XLA:CPU's device-to-host copy is a memory copy; on a TPU
it crosses PCIe, so the stall there is larger (measured here only on XLA:CPU). The emulator is
a single-threaded Python server in this process: its writes compete with the training step for
this host's two cores, so the bucket's "written" times are an upper bound.

    python bench/async_save.py [--n_embd 768] [--n_layer 12] [--rounds 3] [--dir /tmp/async_save_bench] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET = "xla-fsdp-bench"
DEVICES = 4


def _model(args):
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    from transformers import GPT2Config, GPT2LMHeadModel

    import xla_fsdp
    from xla_fsdp.runtime.choice import enter_single_controller

    enter_single_controller()
    torch.manual_seed(0)
    config = GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=12, vocab_size=50257, n_positions=1024,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = xla_fsdp.FSDP(GPT2LMHeadModel(config), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (DEVICES, 16), generator=torch.Generator().manual_seed(0)).to(torch_xla.device())

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    step()
    params = sum(p.numel() for p in model.parameters())  # this host's shards of every parameter
    return model, opt, step, params


def _round(root: str, model, opt, step, number: int) -> dict:
    from xla_fsdp.checkpoint import CheckpointManager

    sync = CheckpointManager(os.path.join(root, "sync"), keep_last=1)
    started = time.perf_counter()
    sync.save(number, model, opt)
    sync_s = time.perf_counter() - started
    beside = CheckpointManager(os.path.join(root, "beside"), keep_last=1, async_save=True)
    started = time.perf_counter()
    beside.save(number, model, opt)
    stall_s = time.perf_counter() - started
    step()  # training goes on while the files are written
    beside.wait()
    return {"sync_s": sync_s, "stall_s": stall_s, "written_s": time.perf_counter() - started}


def _measure(root: str, model, opt, step, rounds: int) -> dict:
    got = [_round(root, model, opt, step, n) for n in range(1, rounds + 1)]
    out = {k: round(statistics.median(r[k] for r in got), 3) for k in got[0]}
    out["stall_vs_sync"] = round(out["stall_s"] / out["sync_s"], 3)
    out["rounds"] = [{k: round(v, 3) for k, v in r.items()} for r in got]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=768)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/async_save_bench")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/async_save_<date>.json)")
    args = ap.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", str(DEVICES))
    from gcp_storage_emulator import server as emulator

    sys.path.insert(0, HERE)
    from common.gcs_requests import free_port

    port = free_port()
    srv = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    srv.start()
    os.environ.update(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}", FSSPEC_GS_TOKEN="anon")
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        model, opt, step, params = _model(args)
        local = _measure(args.dir, model, opt, step, args.rounds)
        bucket = _measure(f"gs://{BUCKET}/run", model, opt, step, args.rounds)
    finally:
        srv.stop()
    folder = os.path.join(args.dir, "sync", f"checkpoint-{args.rounds}")
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    result = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "date": datetime.date.today().isoformat(),
              "command": " ".join([os.path.relpath(sys.argv[0], os.path.join(HERE, ".."))] + sys.argv[1:]),
              "device": f"XLA:CPU, {DEVICES} devices, single controller (measured)", "params": params,
              "checkpoint_bytes": size, "local": local, "bucket": bucket}
    print(f"GPT-2 n_embd {args.n_embd}, {args.n_layer} layers ({params / 1e6:.0f}M parameters), AdamW; "
          f"{DEVICES} XLA:CPU devices; checkpoint {size / 2**20:.0f} MiB; median of {args.rounds} rounds")
    print(f"{'where':8} {'sync save (s)':>14} {'stall beside (s)':>17} {'written (s)':>12} {'stall / sync':>13}")
    for where, got in (("local", local), ("bucket", bucket)):
        print(f"{where:8} {got['sync_s']:14.2f} {got['stall_s']:17.2f} {got['written_s']:12.2f} "
              f"{got['stall_vs_sync']:13.2f}")
    out = args.out or os.path.join(HERE, "results", f"async_save_{result['date']}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
