"""Checkpoint I/O at scale: sharded save and load against torch.save/torch.load, and the
offline consolidation's peak memory against the largest tensor and the model size.

A GPT-2 (default n_embd 1024, 24 layers: 354M parameters, 1.42 GB in fp32) is
built deferred and wrapped on gloo world 4 (one unit per GPT2Block), takes one
AdamW step (so the optimizer holds two moments per parameter), then every rank
  - saves with xla_fsdp.checkpoint.save_checkpoint (all ranks into one directory), and
    with torch.save of {model.state_dict(), optimizer.state_dict()} (its own file);
  - loads each back into the same model and optimizer (load_checkpoint;
    torch.load + load_state_dict).
The slowest rank's time is reported (that is when the job may go on). Then
`python -m xla_fsdp.checkpoint consolidate` runs in a child process and its
peak RSS (ru_maxrss) is compared with the largest tensor and the model size.

    python bench/checkpoint_io.py [--n_embd 1024] [--n_layer 24] [--world 4] [--dir /tmp/ckpt_bench]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from common.gloo import run_distributed_fn


def config(args):
    from transformers import GPT2Config

    return GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=16, vocab_size=50257, n_positions=1024,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def worker(rank, world, tmp, args):
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    import xla_fsdp
    from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = xla_fsdp.deferred_init(GPT2LMHeadModel, config(args))
    model = xla_fsdp.FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    ours = os.path.join(args.dir, "xla_fsdp")
    plain = os.path.join(args.dir, f"torch_save-rank{rank}.pt")
    out = {
        "save_xla_fsdp_s": timed(lambda: save_checkpoint(ours, model, opt, step=1)),
        "save_torch_s": timed(lambda: torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, plain)),
        "load_xla_fsdp_s": timed(lambda: load_checkpoint(ours, model, opt)),
    }

    def torch_load():
        state = torch.load(plain, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    out["load_torch_s"] = timed(torch_load)
    out["bytes_torch_rank"] = os.path.getsize(plain)
    if rank == 0:
        with open(os.path.join(tmp, "times.json"), "w") as f:
            json.dump(out, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=1024)
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/ckpt_bench")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    run_distributed_fn(worker, args.world, args.dir, args)
    times = json.load(open(os.path.join(args.dir, "times.json")))
    ours = os.path.join(args.dir, "xla_fsdp")
    meta = json.load(open(os.path.join(ours, "metadata.json")))
    sizes = {n: 4 * (p["shape"][0] if p["shape"] else 1) * max(1, int(__import__("math").prod(p["shape"][1:])))
             for n, p in meta["params"].items()}
    model_bytes, largest = sum(sizes.values()), max(sizes.values())
    ckpt_bytes = sum(os.path.getsize(os.path.join(ours, f)) for f in os.listdir(ours))

    # the CLI in a fresh interpreter that reports its own peak RSS
    probe = ("import resource, runpy, sys\n"
             f"sys.argv = ['xla_fsdp.checkpoint', 'consolidate', {ours!r}, {os.path.join(args.dir, 'hf')!r}]\n"
             "try:\n    runpy.run_module('xla_fsdp.checkpoint', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    took = time.perf_counter() - start
    peak = int(proc.stdout.split("PEAK")[-1]) * 1024
    baseline = subprocess.run([sys.executable, "-c", "import resource, torch, xla_fsdp.checkpoint; "
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                              check=True, capture_output=True, text=True)
    interpreter = int(baseline.stdout.split()[-1]) * 1024
    mib = 2 ** 20
    print(f"GPT-2 n_embd {args.n_embd}, {args.n_layer} layers: {model_bytes / mib:.0f} MiB of fp32 parameters, "
          f"largest tensor {largest / mib:.0f} MiB; gloo world {args.world}, AdamW state")
    print(f"checkpoint on disk: {ckpt_bytes / mib:.0f} MiB (model + 2 moments); torch.save per rank: "
          f"{times['bytes_torch_rank'] / mib:.0f} MiB x {args.world}")
    print(f"{'':24s} {'xla_fsdp':>10s} {'torch':>10s} {'ratio':>7s}   (slowest rank, s)")
    for what in ("save", "load"):
        a, b = times[f"{what}_xla_fsdp_s"], times[f"{what}_torch_s"]
        print(f"{what:24s} {a:>10.2f} {b:>10.2f} {a / b:>7.2f}x")
    print(f"consolidation: {took:.1f} s, peak RSS {peak / mib:.0f} MiB = largest tensor + "
          f"{(peak - largest) / mib:.0f} MiB ({interpreter / mib:.0f} MiB of it is the interpreter with torch "
          f"imported), {peak / model_bytes:.2f}x the model")


if __name__ == "__main__":
    main()
