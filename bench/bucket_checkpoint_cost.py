"""What a checkpoint costs in a bucket: requests, bytes and time of a sharded save and load of
GPT-2 small (124M parameters, AdamW state) through gcsfs to a local GCS emulator, against the
same save and load on a local directory.

The emulator (gcp-storage-emulator, requirements-test.txt) runs in this process on 127.0.0.1;
every request it serves is counted and timed at its HTTP handler, by kind (object reads,
metadata, uploads, listings, deletes) with the bytes it sent back. The ranks (gloo world 2 by
default, one process each, as bench/checkpoint_io.py) mark the start and end of each phase with
a request to a name under `__phase__/`, which the counter turns into a snapshot (and does not
count). Times are the slowest rank's (barrier to barrier). The emulator is a single-threaded
Python server, so its times are an upper bound on the client's share, not GCS's latency;
request counts and bytes are what carries over to a real bucket.

    python bench/bucket_checkpoint_cost.py [--world 2] [--n_embd 768] [--n_layer 12] [--dir /tmp/bucket_bench] [--out FILE]
"""
import argparse
import collections
import datetime
import json
import os
import shutil
import sys
import threading
import time

from common.gcs_requests import free_port, observe_requests
from common.gloo import run_distributed_fn

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET = "xla-fsdp-bench"
PHASES = ("save_local", "save_bucket", "load_local", "load_bucket")


class Counter:
    """Requests the emulator served, by kind, with seconds spent and bytes sent back."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = collections.Counter()
        self.marks = {}

    def install(self, handler_class):
        def record(handler, kind, seconds, sent):
            with self.lock:
                if "__phase__" in handler.path:  # a rank's phase mark: a snapshot, not counted
                    name = handler.path.split("__phase__", 1)[1].strip("/%2F").split("?", 1)[0].split("%2F")[-1]
                    self.marks[name.split("/")[-1]] = dict(self.now, at=time.perf_counter())
                    return
                self.now[f"{kind}_requests"] += 1
                self.now[f"{kind}_seconds"] += seconds
                self.now[f"{kind}_bytes_out"] += sent

        observe_requests(handler_class, record)

    def between(self, start, end):
        a, b = self.marks[start], self.marks[end]
        keys = sorted(k for k in set(a) | set(b) if k != "at")
        return {k: round(b.get(k, 0) - a.get(k, 0), 3) if k.endswith("seconds") else b.get(k, 0) - a.get(k, 0)
                for k in keys}


def config(args):
    from transformers import GPT2Config

    return GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=12, vocab_size=50257, n_positions=1024,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def worker(rank, world, tmp, args, bucket_url):
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    import xla_fsdp
    from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint, storage

    torch.manual_seed(0)
    model = xla_fsdp.deferred_init(GPT2LMHeadModel, config(args))
    model = xla_fsdp.FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    fs = storage.storage_for(bucket_url).fs

    def mark(name):
        if rank == 0:
            fs.invalidate_cache()
            fs.exists(f"{BUCKET}/__phase__/{name}")

    def timed(name, fn):
        dist.barrier()
        mark(f"{name}-start")
        start = time.perf_counter()
        fn()
        dist.barrier()
        took = time.perf_counter() - start
        mark(f"{name}-end")
        return took

    local = os.path.join(tmp, "local")
    out = {
        "save_local": timed("save_local", lambda: save_checkpoint(local, model, opt, step=1)),
        "save_bucket": timed("save_bucket", lambda: save_checkpoint(bucket_url, model, opt, step=1)),
        "load_local": timed("load_local", lambda: load_checkpoint(local, model, opt)),
        "load_bucket": timed("load_bucket", lambda: load_checkpoint(bucket_url, model, opt)),
    }
    if rank == 0:
        with open(os.path.join(tmp, "times.json"), "w") as f:
            json.dump(out, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=768)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/bucket_bench")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/bucket_checkpoint_cost_<date>.json)")
    ap.add_argument("--label", default="", help="what library this measures (e.g. a commit), stored in the JSON")
    args = ap.parse_args()
    from gcp_storage_emulator import server as emulator

    counter = Counter()
    counter.install(emulator.RequestHandler)
    port = free_port()
    srv = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    srv.start()
    os.environ.update(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}", FSSPEC_GS_TOKEN="anon")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    try:
        run_distributed_fn(worker, args.world, args.dir, args, f"gs://{BUCKET}/run/checkpoint-1")
    finally:
        srv.stop()
    times = json.load(open(os.path.join(args.dir, "times.json")))
    local = os.path.join(args.dir, "local")
    ckpt_bytes = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local))
    result = {"what": __doc__.split("\n\n")[0].replace("\n", " "),
              "date": datetime.date.today().isoformat(),
              "command": " ".join([os.path.relpath(sys.argv[0], os.path.join(HERE, ".."))] + sys.argv[1:]),
              "label": args.label, "world": args.world, "n_embd": args.n_embd, "n_layer": args.n_layer,
              "checkpoint_bytes": ckpt_bytes, "files": len(os.listdir(local)),
              "seconds": {k: round(v, 2) for k, v in times.items()}, "bucket_requests": {}}
    print(f"GPT-2 n_embd {args.n_embd}, {args.n_layer} layers, AdamW; gloo world {args.world}; checkpoint "
          f"{ckpt_bytes / 2**20:.0f} MiB in {result['files']} files")
    for what in ("save", "load"):
        got = counter.between(f"{what}_bucket-start", f"{what}_bucket-end")
        result["bucket_requests"][what] = got
        local_s, bucket_s = times[f"{what}_local"], times[f"{what}_bucket"]
        reqs = ", ".join(f"{k[:-9]} {v}" for k, v in got.items() if k.endswith("_requests"))
        print(f"{what}: local {local_s:.2f} s, bucket {bucket_s:.2f} s ({bucket_s / local_s:.1f}x); "
              f"requests: {reqs}; read bytes sent {got.get('read_bytes_out', 0) / 2**20:.0f} MiB; "
              f"emulator busy {sum(v for k, v in got.items() if k.endswith('seconds')):.1f} s")
    out = args.out or os.path.join(HERE, "results", f"bucket_checkpoint_cost_{result['date']}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
