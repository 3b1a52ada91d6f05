"""One host of an FSDP2 job saving and loading DCP checkpoints across virtual hosts
([Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py; [Note: virtual hosts] in xla_fsdp/runtime/hosts.py).

tests/test_fsdp2_pods.py starts it once per host (XLA_FSDP_VIRTUAL_HOSTS / _INDEX set for several),
CPU_NUM_DEVICES set per process. Every host feeds the same global batch (a virtual host runs the
whole program) and writes OUT-host<i>.pt.

  pods_worker.py save ROOT OUT [MESH]  train K steps (dcp_worker's small Llama, fully_shard per layer
        and root; MESH "hsdp": a (hosts, devices // hosts) dp_replicate x dp_shard mesh); DCP-save model
        and AdamW state to ROOT/step-K and to ROOT/latest; train step K+1 (the uninterrupted next
        loss); save again to ROOT/latest, where host 1 SIGKILLs itself once its data file is written
        (before DCP's metadata): the job dies mid-save over a complete checkpoint
  pods_worker.py load ROOT OUT [MESH]  a fresh model: dcp.load of ROOT/latest (must fail), then of
        ROOT/step-K and set_state_dict; the state, the rows each host read, the next step's loss
"""
from __future__ import annotations

import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: virtual_hosts_cases

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import dcp_worker as dw  # noqa: E402  the small Llama, its steps, max_diff, spec_faults

K = 2  # steps before the save
T0 = time.perf_counter()


def log(what: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


def build(seed: int, mesh: str):
    """dcp_worker's model and AdamW, on an HSDP mesh with the replica dim across hosts for "hsdp"."""
    if mesh != "hsdp":
        return dw.build(seed)
    import torch.distributed as dist
    import torch_xla
    from torch.distributed.device_mesh import init_device_mesh

    devices = torch_xla.runtime.global_runtime_device_count()
    hosts = dist.get_world_size()
    device_mesh = init_device_mesh("xla", (hosts, devices // hosts), mesh_dim_names=("dp_replicate", "dp_shard"))
    with torch.device("meta"):
        model = dw.ex.Llama(dw.CONFIG)
    for layer in model.layers:
        dw.fsdp2.fully_shard(layer, mesh=device_mesh)
    dw.fsdp2.fully_shard(model, mesh=device_mesh)
    model.to_empty(device=torch_xla.device())
    torch.manual_seed(seed)
    model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch_xla.sync()
    return model, optimizer


def full_cpu(model, optimizer) -> dict:
    """Model and optimizer state, whole, on the CPU (a virtual host reads every device)."""
    msd, osd = get_state_dict(model, optimizer)

    def whole(v):
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        if isinstance(v, list):
            return [whole(x) for x in v]
        if isinstance(v, torch.Tensor):
            return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        return v
    return {"model": whole(msd), "optim": whole(osd)}


def save(root: str, out: str, mesh: str) -> None:
    from virtual_hosts_cases import _counting_moves
    from xla_fsdp.fsdp.dcp import storage_writer
    from xla_fsdp.runtime.hosts import host_view

    dw.start()
    view = host_view()
    model, optimizer = build(1, mesh)
    log("built")
    losses = [dw.train_step(model, optimizer, s) for s in range(K)]
    log(f"trained {K} steps")
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "step": K}
    t0 = time.perf_counter()
    with _counting_moves(view) as moved:
        dcp.save(state, storage_writer=storage_writer(os.path.join(root, f"step-{K}")))
    seconds = time.perf_counter() - t0
    dcp.save(state, storage_writer=storage_writer(os.path.join(root, "latest")))
    result = {"host": view.index, "hosts": view.count, "devices": list(view.devices), "losses": losses,
              "ref": full_cpu(model, optimizer), "save_seconds": seconds, "moved": moved}
    result["next_loss"] = dw.train_step(model, optimizer, K)
    torch.save(result, f"{out}-host{view.index}.pt")
    log(f"host {view.index}: saved step {K}, next loss {result['next_loss']}")
    # the same path again, one step later; host 1 dies between its data and DCP's metadata
    msd, osd = get_state_dict(model, optimizer)
    writer = storage_writer(os.path.join(root, "latest"))
    if view.index == 1:
        write_data = writer.write_data

        def write_then_die(plan, planner):
            write_data(plan, planner).wait()
            print("host 1 wrote its data of the second save; SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        writer.write_data = write_then_die
    t0 = time.perf_counter()
    try:
        dcp.save({"model": msd, "optim": osd, "step": K + 1}, storage_writer=writer)
    except BaseException as e:  # DCP raises CheckpointException (a BaseException) for a lost host
        print(f"host {view.index}: the second save failed after {time.perf_counter() - t0:.1f} s: "
              f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        sys.exit(3)
    print(f"host {view.index}: the second save returned", flush=True)


def load(root: str, out: str, mesh: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from xla_fsdp.fsdp.dcp import is_complete, storage_reader
    from xla_fsdp.runtime.hosts import host_view

    torch_xla = dw.start()
    view = host_view()
    model, optimizer = build(5, mesh)
    log("built")
    result = {"host": view.index, "hosts": view.count, "devices": list(view.devices),
              "complete": {name: is_complete(os.path.join(root, name)) for name in (f"step-{K}", "latest")}}
    msd, osd = get_state_dict(model, optimizer)
    try:
        dcp.load({"model": msd, "optim": osd, "step": 0}, storage_reader=storage_reader(os.path.join(root, "latest")))
        result["killed_save"] = None
    except BaseException as e:
        result["killed_save"] = f"{type(e).__name__}: {str(e)[:400]}"
    reads = []  # (key, first row, last row + 1) of the full tensor, each tensor item DCP read here
    read_data = FileSystemReader.read_data

    def logged(self, plan, planner):
        for item in plan.items:
            if item.storage_index.offset is None:  # bytes (param_groups, the step number)
                continue
            start = item.storage_index.offset[0] + item.storage_offsets[0] if len(item.lengths) else 0
            reads.append((item.dest_index.fqn, start, start + item.lengths[0] if len(item.lengths) else 1))
        return read_data(self, plan, planner)
    FileSystemReader.read_data = logged
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "step": 0}
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=storage_reader(os.path.join(root, f"step-{K}")))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    FileSystemReader.read_data = read_data
    result.update(load_seconds=time.perf_counter() - t0, step=state["step"], reads=reads,
                  got=full_cpu(model, optimizer), specs=dw.spec_faults(model, optimizer),
                  devices_total=torch_xla.runtime.global_runtime_device_count())
    log(f"loaded in {result['load_seconds']:.2f} s")
    result["next_loss"] = dw.train_step(model, optimizer, K)
    torch.save(result, f"{out}-host{view.index}.pt")
    log("done")


if __name__ == "__main__":
    mode, root, out, *rest = sys.argv[1:]
    {"save": save, "load": load}[mode](root, out, rest[0] if rest else "default")
    sys.stdout.flush()
