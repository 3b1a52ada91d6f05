"""Rank-side half of tests/test_checkpoint_wrapper_keys.py (gloo processes).

A unit that is torch's CheckpointWrapper has tree names with
`_checkpoint_wrapped_module.` in them, which its state_dict hook strips: every
state dict and checkpoint must use the stripped keys (the unwrapped model's)
and lose nothing. Each rank writes what the parent compares with the plain
model.
"""
import os

import torch
import torch.nn as nn


class Norm(nn.Module):
    """A persistent buffer (running mean) and a non-persistent one (not in state_dict())."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.register_buffer("running", torch.randn(dim))
        self.register_buffer("scratch", torch.zeros(dim), persistent=False)

    def forward(self, x):
        return (x - self.running) * self.weight


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 5 and 7 rows do not divide by 2: shards carry padding
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Sequential(nn.Linear(5, 7), Norm(7)), nn.Linear(7, 3))


def wrap(model: nn.Module, checkpoint_wrapped: bool = True) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from xla_fsdp import FSDP

    if checkpoint_wrapped:
        model[2] = FSDP(checkpoint_wrapper(model[2]))
        model[3] = FSDP(checkpoint_wrapper(model[3]))
    else:
        model[2] = FSDP(model[2])
        model[3] = FSDP(model[3])
    return FSDP(model)


def run(rank, world, out):
    """Each result to its own file (an error as its message: the parent fails that test alone;
    every error here is raised on every rank, before any collective)."""
    from xla_fsdp.checkpoint import (consolidate, full_state_dict, load_checkpoint, load_full_state_dict,
                                     load_sharded_state_dict, save_checkpoint, sharded_state_dict)

    def save(name, fn):
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - reported by the parent's assertion
            value = f"{type(e).__name__}: {e}"
        if rank == 0:
            torch.save(value, os.path.join(out, name))

    model = wrap(build(0))
    save("full.pt", lambda: full_state_dict(model))
    # torch_xla's per-rank flow: each rank's state_dict() and the metadata to consolidate it
    torch.save({"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()},
               os.path.join(out, f"rank{rank}.pt"))

    def full_into_fresh():  # into a fresh, differently initialised wrapped model
        fresh = wrap(build(1))
        load_full_state_dict(fresh, full_state_dict(model, rank0_only=False))
        return full_state_dict(fresh)

    def sharded_into_other():
        other = wrap(build(2))
        load_sharded_state_dict(other, sharded_state_dict(model))
        return full_state_dict(other)

    save("full_loaded.pt", full_into_fresh)
    save("sharded_loaded.pt", sharded_into_other)
    save("sharded_keys.pt", lambda: sorted(sharded_state_dict(model)["params"]))

    # a checkpoint, loaded into a wrapped model and into one without CheckpointWrapper
    path = save_checkpoint(os.path.join(out, "ckpt"), model)
    for name, ckpt_wrapped in (("ckpt_loaded.pt", True), ("ckpt_loaded_unwrapped.pt", False)):
        def load(ckpt_wrapped=ckpt_wrapped):
            target = wrap(build(3), checkpoint_wrapped=ckpt_wrapped)
            load_checkpoint(path, target)
            return full_state_dict(target)

        save(name, load)
    if rank == 0:
        consolidate(path, os.path.join(out, "consolidated"))
