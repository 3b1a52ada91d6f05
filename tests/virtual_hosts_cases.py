"""One virtual host of an SPMD job ([Note: virtual hosts] in xla_fsdp/runtime/hosts.py), run as a script.

    XLA_FSDP_VIRTUAL_HOSTS=N XLA_FSDP_VIRTUAL_HOST_INDEX=i CPU_NUM_DEVICES=D \\
        python tests/virtual_hosts_cases.py save|resume ENGINE LAYOUT KIND ROOT OUT [kill|export|count]
    python tests/virtual_hosts_cases.py die ENGINE LAYOUT KIND ROOT OUT HOST SIGNAL

Without XLA_FSDP_VIRTUAL_HOSTS it is one host driving all D devices. ENGINE: "collectives" (the
single controller) or "gspmd"; LAYOUT: FULL_SHARD or HYBRID_SHARD (the devices split in two
sharding groups / a mesh (2, D/2) with a replica axis: across hosts when there are 2 or more).

save: train K steps (checkpoint_cases), save ROOT/checkpoint-K with a CheckpointManager (what moved
from the devices to host memory meanwhile in OUT-host<i>-moved.json); with
"kill", train one more step and save checkpoint-(K+1), where host 1 SIGKILLs itself after writing
part of its tensor file. resume: load the newest complete checkpoint under ROOT, train MORE steps,
and write OUT-host<i>.pt: losses, full parameters, the rows this host read.

die: train K steps and save checkpoint-K, train one more step, then host HOST sends itself SIGNAL
("KILL": the process dies; "STOP": it freezes, as a host that vanished without closing its
connections) after writing OUT-dead (the time) while the others save checkpoint-(K+1).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_cases as cc  # noqa: E402


def _kwargs(engine: str, layout: str, devices: int) -> dict:
    if engine == "gspmd":
        if layout == "HYBRID_SHARD":
            import numpy as np
            import torch_xla.distributed.spmd as xs

            mesh = xs.Mesh(np.arange(devices), (2, devices // 2), ("replica", "fsdp"))
            return {"engine": "spmd", "mesh": mesh}
        return {"engine": "spmd"}
    return cc.Layout(layout).kwargs(devices)


def main(argv) -> None:
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_xla

    from xla_fsdp.runtime import hosts
    from xla_fsdp.checkpoint import CheckpointManager, format as fmt

    if argv[0] == "partial":
        return partial_replication(argv[1], argv[2])
    if argv[0] == "die":
        return die(*argv[1:])
    mode, engine, layout, kind, root, out = argv[:6]
    kill = len(argv) > 6 and argv[6] == "kill"
    view = hosts.host_view()
    devices = xr.global_runtime_device_count()
    device = torch_xla.device()
    manager = CheckpointManager(root)
    model, opt = cc.wrapped(kind, "adamw", _kwargs(engine, layout, devices), seed=0 if mode == "save" else 7)
    if mode == "save":
        losses = cc.train(model, opt, kind, range(cc.K), device=device, sync=torch_xla.sync, global_batch=True)
        with _counting_moves(view) as moved:
            manager.save(cc.K, model, opt, extra_state={"losses": losses})
        with open(f"{out}-host{view.index}-moved.json", "w") as f:
            json.dump(moved, f)
        if len(argv) > 6 and argv[6] == "export":
            from xla_fsdp.checkpoint import save_pretrained

            save_pretrained(model, out)
        if kill:
            cc.train(model, opt, kind, range(cc.K, cc.K + 1), device=device, sync=torch_xla.sync, global_batch=True)
            if view.index == 1:
                real = fmt.write_safetensors

                def dying(path, entries, metadata=None):
                    def first_then_die():
                        tensor = entries[0][3]()
                        os.kill(os.getpid(), signal.SIGKILL)
                        return tensor
                    return real(path, [entries[0][:3] + (first_then_die,)] + list(entries[1:]), metadata)
                fmt.write_safetensors = dying
            manager.save(cc.K + 1, model, opt)
        return
    reads = []
    real_read = fmt.RowIndex.read_rows

    def logged(self, key, start, stop, out=None):
        reads.append((key, start, stop))
        return real_read(self, key, start, stop, out)
    fmt.RowIndex.read_rows = logged
    got = manager.load_latest(model, opt)
    losses = cc.train(model, opt, kind, range(cc.K, cc.K + cc.MORE), device=device, sync=torch_xla.sync,
                      global_batch=True)
    params = {n: p.detach().cpu() for n, p in model.state_dict().items()} if engine == "gspmd" \
        else cc.full_params(model)
    torch.save({"step": got["step"], "losses": losses, "params": params, "reads": reads,
                "devices": list(view.devices), "hosts": view.count},
               f"{out}-host{view.index}.pt")


@contextlib.contextmanager
def _counting_moves(view):
    """What torch_xla moves from the devices to host memory through `_get_local_shards`: bytes in
    all ("all": every device of this process; "own": this host's devices, what a pod host moves),
    the most one call moved ("largest_call") and the most such shard memory alive at once ("peak":
    at each call, what earlier calls moved and is still referenced, plus the call's own)."""
    import weakref

    import torch_xla

    real = torch_xla._XLAC._get_local_shards
    moved = {"own": 0, "all": 0, "largest_call": 0, "peak": 0}
    alive = []  # (weak reference to its storage: views keep it alive, bytes) of every shard moved so far

    def counted(tensors):
        out = real(tensors)
        call = 0
        for shards in out:
            for data, device in shards:
                n = data.numel() * data.element_size()
                call += n
                moved["own"] += n if view.owns(device) else 0
                alive.append((weakref.ref(data.untyped_storage()), n))
        moved["all"] += call
        moved["largest_call"] = max(moved["largest_call"], call)
        moved["peak"] = max(moved["peak"], sum(n for ref, n in alive if ref() is not None))
        return out
    torch_xla._XLAC._get_local_shards = counted
    try:
        yield moved
    finally:
        torch_xla._XLAC._get_local_shards = real


def die(engine: str, layout: str, kind: str, root: str, out: str, host: str, sig: str) -> None:
    import time

    import torch_xla
    import torch_xla.runtime as xr

    from xla_fsdp.runtime import hosts
    from xla_fsdp.checkpoint import CheckpointManager

    view = hosts.host_view()
    device = torch_xla.device()
    manager = CheckpointManager(root)
    model, opt = cc.wrapped(kind, "adamw", _kwargs(engine, layout, xr.global_runtime_device_count()))
    cc.train(model, opt, kind, range(cc.K), device=device, sync=torch_xla.sync, global_batch=True)
    manager.save(cc.K, model, opt)
    cc.train(model, opt, kind, range(cc.K, cc.K + 1), device=device, sync=torch_xla.sync, global_batch=True)
    if view.index == int(host):
        with open(out + "-dead.tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(out + "-dead.tmp", out + "-dead")
        os.kill(os.getpid(), getattr(signal, "SIG" + sig))
    manager.save(cc.K + 1, model, opt)
    print("saved checkpoint", cc.K + 1, flush=True)


def partial_replication(path: str, out: str) -> None:
    """torch_xla's dropped-tensor case (pytorch/xla#7118-style): mesh (2, 2), a weight sharded on the
    first axis and replicated on the second (two devices of one host hold the same rows), one on the
    second axis, one replicated. Save, load into other values, write both to OUT-host<i>.pt."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from xla_fsdp.runtime import hosts
    from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint

    mesh = xs.Mesh(np.arange(4), (2, 2), ("x", "y"))

    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 5), "b": torch.nn.Linear(5, 7)}).to(torch_xla.device())
        xs.mark_sharding(m["a"].weight, mesh, ("x", None))
        xs.mark_sharding(m["b"].weight, mesh, ("y", None))
        xs.mark_sharding(m["a"].bias, mesh, (None,))
        return m

    saved = model(0)
    save_checkpoint(path, saved)
    loaded = model(1)
    load_checkpoint(path, loaded)
    specs = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in loaded.named_parameters()}
    torch.save({"saved": {n: p.detach().cpu() for n, p in saved.named_parameters()},
                "loaded": {n: p.detach().cpu() for n, p in loaded.named_parameters()}, "specs": specs},
               f"{out}-host{hosts.host_view().index}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # skip the gloo group's teardown races at exit
