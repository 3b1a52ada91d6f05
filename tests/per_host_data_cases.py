"""One host of an SPMD job reading per-host batches ([Note: per-host batches] in
xla_fsdp/data/per_host.py), run as a script by tests/test_per_host_data.py:

    CPU_NUM_DEVICES=4 [XLA_FSDP_VIRTUAL_HOSTS=2 XLA_FSDP_VIRTUAL_HOST_INDEX=i] \\
        python tests/per_host_data_cases.py OUT

For a 1-D mesh and a 2-D mesh with a replica axis whose devices are not contiguous per host, it
runs run_clm's training loop (`xla_fsdp.train.loop.train`, the step replaced by one that only
builds the step's global batches through `StepContext.to_device`) over `BlockBatches` of this
host's rows: STEPS steps from the start and again resumed at step RESUME. It saves, per step, the
local batches, the global batches read back, every device's shard, and the block ids it read;
also where torch_xla places each row of a batch-sharded tensor, and a padded global batch.
Without XLA_FSDP_VIRTUAL_HOSTS it is today's single host (the whole batch, `mark_sharding`).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import torch

BLOCKS, WIDTH, GLOBAL, SEED = 40, 3, 8, 5  # 5 global batches per epoch
STEPS, RESUME, ACCUMULATE = 5, 3, 2        # 2 steps per epoch: the runs cross two epochs
MESHES = {"1d": ((4,), ("fsdp",), [0, 1, 2, 3]),
          "2d": ((2, 2), ("replica", "fsdp"), [0, 2, 1, 3])}  # tiles 0,2 on host 0's devices 0,1


class Recorded:
    """The training blocks, recording which block ids each read takes."""

    def __init__(self, blocks: torch.Tensor, reads: list):
        self.blocks, self.reads = blocks, reads
        self.shape = blocks.shape

    def __getitem__(self, index):
        self.reads.append(torch.as_tensor(index).reshape(-1).tolist())
        return self.blocks[index]


class Meter:
    def restart(self, step):
        pass

    def close(self, step):
        return {"tokens_per_s": 0.0, "step_time_s": 0.0, "mfu": 0.0}

    def summary(self, step):
        return {}


def placement(mesh, rows: int) -> dict:
    """{device: [start, stop)} of a batch-sharded [rows] tensor, as torch_xla lays it out."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from xla_fsdp.runtime.mesh import batch_spec

    t = torch.arange(rows).to(torch_xla.device())
    xs.mark_sharding(t, mesh, batch_spec(t, mesh))
    where = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    return {device: (index[0].start, index[0].stop) for (_, device), (_, index) in zip(shards, where)}


def shards_of(tensor) -> dict:
    import torch_xla

    return {device: data.clone() for data, device in torch_xla._XLAC._get_local_shards([tensor])[0]}


def run(mesh, hb, start: int) -> dict:
    """loop.train over this host's batches from `start` to STEPS; what each step saw."""
    import torch_xla

    from xla_fsdp.train import data, loop

    reads, steps = [], []
    ctx = loop.StepContext(torch_xla.device(), mesh, host_batches=None if hb.single else hb)

    def step(model, optimizer, scheduler, micro_batches, ctx, max_grad_norm):
        globs = [ctx.to_device(b) for b in micro_batches]
        torch_xla.sync()
        steps.append({"local": [b.clone() for b in micro_batches], "global": [g.cpu() for g in globs],
                      "shards": [shards_of(g) for g in globs],
                      "spec": [torch_xla._XLAC._get_xla_sharding_spec(g) for g in globs]})
        optimizer.step()
        scheduler.step()
        return torch.tensor(1.0)

    loop.train_step, loop._wait = step, lambda: None
    blocks = torch.arange(BLOCKS * WIDTH).view(BLOCKS, WIDTH)
    batches = data.BlockBatches(Recorded(blocks, reads), GLOBAL, seed=SEED,
                                rows=None if hb.single else hb.rows(GLOBAL))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = loop.make_scheduler(optimizer, 0, STEPS)
    args = SimpleNamespace(gradient_accumulation_steps=ACCUMULATE, logging_steps=1, logging_strategy="steps",
                           save_strategy="no", max_grad_norm=0.0)
    result = loop.train(torch.nn.Module(), optimizer, scheduler, batches, STEPS, ctx, Meter(), args, log=lambda *a: None,
                        start_step=start)
    return {"steps": steps, "reads": reads, "done": result.steps}


def main(out: str) -> None:
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_xla.distributed.spmd as xs

    from xla_fsdp.data import HostBatches
    from xla_fsdp.runtime.hosts import host_view

    view = host_view()
    report = {"host": view.index, "hosts": view.count, "devices": list(view.devices), "meshes": {}}
    for name, (shape, axes, ids) in MESHES.items():
        mesh = xs.Mesh(np.array(ids), shape, axes)
        hb = HostBatches(mesh, view)
        padded = torch.arange(6 * WIDTH).view(6, WIDTH) + 1000  # 6 rows over 4 devices: tiles of 2, one empty
        if hb.single:
            from xla_fsdp.train.loop import StepContext
            import torch_xla

            glob = StepContext(torch_xla.device(), mesh).to_device(padded)
        else:
            glob = hb.to_global(hb.select(padded), 6)
        report["meshes"][name] = {
            "logical": np.asarray(mesh.get_logical_mesh()).tolist(),
            "rows": hb.rows(GLOBAL).tolist(),
            "placement": {rows: placement(mesh, rows) for rows in (GLOBAL, 6)},
            "padded": {"global": glob.cpu(), "shards": shards_of(glob)},
            "whole": run(mesh, hb, 0), "resumed": run(mesh, hb, RESUME)}
    torch.save(report, out)


if __name__ == "__main__":
    main(sys.argv[1])
