"""Host memory of a HYBRID checkpoint save at 2 virtual hosts: the single controller, GPT-2 with
HYBRID_SHARD over 8 XLA:CPU devices (sharding groups 0-3 and 4-7, one replica per host), one AdamW
step, then `save_checkpoint` on both hosts while each samples its own resident memory.

Each host reports: its RSS when the save starts and at its peak during the save (sampled every
2 ms from /proc/self/statm), what torch_xla moved from the devices to host memory
(`_get_local_shards`: from all 8 devices of the process, and from the host's own 4, what a pod
host moves) and what it wrote. On XLA:CPU the devices' memory is host memory too, so the RSS at
the start already holds the model and optimizer (twice: HYBRID's two replicas); the rise during
the save is what the save costs. A virtual host drives every device, so its "all" bytes include
the other host's blocks ([Note: virtual hosts] in xla_fsdp/runtime/hosts.py).

    python bench/hybrid_save_memory.py [--n_embd 768] [--n_layer 12] [--out results.json]

To compare with another version of the library, run it with PYTHONPATH pointing at that
version's package (the script takes `xla_fsdp` from wherever Python finds it).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

DEVICES, HOSTS = 8, 2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host(args) -> None:
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    from transformers import GPT2Config, GPT2LMHeadModel

    import xla_fsdp
    from xla_fsdp.runtime import hosts
    from xla_fsdp.checkpoint import save_checkpoint

    view = hosts.host_view()
    device = torch_xla.device()
    torch.manual_seed(0)
    config = GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=12, vocab_size=50257, n_positions=1024,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    model = xla_fsdp.FSDP(model, sharding_strategy="HYBRID_SHARD", sharding_groups=[[0, 1, 2, 3], [4, 5, 6, 7]],
                          auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (DEVICES, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()
    import gc

    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # the step has run: its results are in memory before the save starts
    gc.collect()
    hosts.host_group().barrier()  # both hosts start the save together

    real = torch_xla._XLAC._get_local_shards
    moved = {"all": 0, "own": 0}

    def counted(tensors):
        out = real(tensors)
        for shards in out:
            for data, dev in shards:
                n = data.numel() * data.element_size()
                moved["all"] += n
                moved["own"] += n if view.owns(dev) else 0
        return out
    torch_xla._XLAC._get_local_shards = counted
    peak = [_rss()]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)
    start = _rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    save_checkpoint(args.dir, model, opt, step=1)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    written = os.path.getsize(os.path.join(args.dir, f"shards-rank{view.index:05d}.safetensors"))
    report = {"host": view.index, "params": params, "rss_at_start": start, "rss_peak": peak[0],
              "rss_rise": peak[0] - start, "moved_all_devices": moved["all"], "moved_own_devices": moved["own"],
              "written": written, "save_seconds": round(seconds, 2)}
    with open(os.path.join(args.tmp, f"host{view.index}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--out", default=None, help="write the two hosts' reports to this JSON file")
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host:
        return host(args)
    tmp = tempfile.mkdtemp(prefix="hybrid_save_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(HOSTS):
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), XLA_FSDP_VIRTUAL_HOSTS=str(HOSTS), XLA_FSDP_VIRTUAL_HOST_INDEX=str(i),
                   TF_CPP_MIN_LOG_LEVEL="2")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--host", "--n_embd",
                                       str(args.n_embd), "--n_layer", str(args.n_layer), "--dir",
                                       os.path.join(tmp, "ckpt"), "--tmp", tmp], env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a host failed ({p.returncode})")
    reports = [json.load(open(os.path.join(tmp, f"host{i}.json"))) for i in range(HOSTS)]
    import xla_fsdp

    result = {"library": os.path.dirname(xla_fsdp.__file__), "n_embd": args.n_embd, "n_layer": args.n_layer,
              "hosts": reports}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
