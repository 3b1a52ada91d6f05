"""Shared pieces of the checkpoint tests: train some steps, save, load on another layout, go on.

Every run trains the parity models (parity_cases) on the global batch of
step `s` (each rank its slice), so any split of a run into "train k steps,
save, load elsewhere, train more" must give the losses and parameters of one
uninterrupted run, which the unsharded eager reference computes.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List

import torch

import parity_cases as pc

K = 3  # steps before the save
MORE = 3  # steps after the load


@dataclasses.dataclass(frozen=True)
class Layout:
    """A sharding strategy for a given world size (HYBRID: the world split in halves)."""

    strategy: str  # FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD

    def kwargs(self, world: int) -> dict:
        if self.strategy == "HYBRID_SHARD" and world > 1:
            half = max(world // 2, 1)
            return {"sharding_strategy": "HYBRID_SHARD",
                    "sharding_groups": [list(range(i, i + half)) for i in range(0, world, half)]}
        if self.strategy == "HYBRID_SHARD":
            return {}
        return {"sharding_strategy": self.strategy}


def reference(kind: str, optim: str, steps: int) -> Dict:
    case = pc.Case("ref", kind, optim)
    return pc.train_reference(case, steps=steps)


def train(model, opt, kind: str, steps, rank: int = 0, world: int = 1, device=None, sync=None,
          global_batch: bool = False) -> List[float]:
    """Train on steps `steps` (an iterable of step numbers); returns each step's loss, averaged over
    ranks when `world` > 1 under torch.distributed."""
    losses = []
    per = pc.GLOBAL_BATCH // world
    for step in steps:
        x, y = pc.batch(kind, step)
        if not global_batch:
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = pc.loss_fn(kind, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sync is not None:
            sync()
        losses.append(loss.detach())
    values = torch.tensor([float(l.cpu()) for l in losses])
    if world > 1 and not global_batch:
        import torch.distributed as dist

        dist.all_reduce(values)
        values /= world
    return values.tolist()


def wrapped(kind: str, optim: str, kwargs: dict, seed: int = 0):
    case = pc.Case("ckpt", kind, optim, fsdp=tuple(kwargs.items()))
    model = pc.wrap(case, pc.build_model(kind, seed=seed))
    return model, pc.make_optimizer(optim, model.parameters())


def full_params(model) -> Dict[str, torch.Tensor]:
    from xla_fsdp.checkpoint import full_state_dict

    return {k: v for k, v in full_state_dict(model, rank0_only=False).items()}


# -- gloo workers (module level: spawned processes import them) ------------------------

def save_worker(rank: int, world: int, tmp: str, jobs: List[dict]) -> None:
    """jobs: {"kind", "optim", "layout", "path"}; trains K steps on `world` ranks and saves."""
    from xla_fsdp.checkpoint import save_checkpoint

    for job in jobs:
        model, opt = wrapped(job["kind"], job["optim"], Layout(job["layout"]).kwargs(world))
        losses = train(model, opt, job["kind"], range(K), rank, world)
        save_checkpoint(job["path"], model, opt, step=K, extra_state={"losses": losses})


def resume_worker(rank: int, world: int, tmp: str, jobs: List[dict]) -> None:
    """jobs: {"kind", "optim", "layout", "path", "name"}; loads into a differently seeded model
    on `world` ranks, trains MORE steps, writes losses and full parameters."""
    from xla_fsdp.checkpoint import load_checkpoint

    out = {}
    for job in jobs:
        model, opt = wrapped(job["kind"], job["optim"], Layout(job["layout"]).kwargs(world), seed=7)
        got = load_checkpoint(job["path"], model, opt)
        losses = train(model, opt, job["kind"], range(K, K + MORE), rank, world)
        out[job["name"]] = {"step": got["step"], "losses": losses, "params": full_params(model)}
    if rank == 0:
        torch.save(out, os.path.join(tmp, f"resumed-w{world}.pt"))


# -- one process driving several devices (run as a script: SPMD mode is process-wide) -----

def spmd_main(argv: List[str]) -> None:
    """checkpoint_cases.py save|resume ENGINE TMP JOBS_JSON, under torch_xla's SPMD runtime.

    ENGINE: "collectives" (the single-controller runtime) or "gspmd" (engine="spmd").
    save: train K steps and save each job; resume: load each job into a fresh model,
    train MORE steps and write losses and full parameters to TMP/resumed-<engine>.pt.
    """
    import json

    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_xla

    from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint

    mode, engine, tmp, jobs = argv[0], argv[1], argv[2], json.loads(argv[3])
    devices = xr.global_runtime_device_count()
    device = torch_xla.device()
    out = {}
    for job in jobs:
        kwargs = {"engine": "spmd"} if engine == "gspmd" else Layout(job["layout"]).kwargs(devices)
        model, opt = wrapped(job["kind"], job["optim"], kwargs, seed=0 if mode == "save" else 7)
        if mode == "save":
            losses = train(model, opt, job["kind"], range(K), device=device, sync=torch_xla.sync, global_batch=True)
            save_checkpoint(job["path"], model, opt, step=K, extra_state={"losses": losses})
        else:
            got = load_checkpoint(job["path"], model, opt)
            losses = train(model, opt, job["kind"], range(K, K + MORE), device=device, sync=torch_xla.sync,
                           global_batch=True)
            params = {n: p.detach().cpu() for n, p in model.state_dict().items()} if engine == "gspmd" \
                else full_params(model)
            out[job["name"]] = {"step": got["step"], "losses": losses, "params": params}
    if mode == "resume":
        torch.save(out, os.path.join(tmp, f"resumed-{engine}.pt"))


if __name__ == "__main__":
    import sys

    spmd_main(sys.argv[1:])


def export_worker(rank: int, world: int, tmp: str) -> None:
    """Train GPT-2 2 steps on `world` gloo ranks, save, and keep the model's logits on a batch."""
    from xla_fsdp.checkpoint import save_checkpoint

    model, opt = wrapped("gpt2", "adamw", {})
    train(model, opt, "gpt2", range(2), rank, world)
    save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, step=2)
    x, _ = pc.batch("gpt2", 7)
    with torch.no_grad():
        logits = model(input_ids=x).logits  # every rank the whole batch: the same logits
    if rank == 0:
        torch.save(logits, os.path.join(tmp, "logits.pt"))
