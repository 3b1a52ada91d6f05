"""Rank-side halves of tests/test_state_dict.py (run in gloo processes)."""
import os

import torch

from parity_cases import Case, GLOBAL_BATCH, batch, build_model, loss_fn, wrap

CASE = Case("sd", "gpt2", "adamw")


def stateless_sgd(params):
    """A model checkpoint carries no optimizer state, so resuming is exact only without it."""
    return torch.optim.SGD(params, lr=0.1)


def _train(model, rank, world, steps, start=0):
    opt = stateless_sgd(model.parameters())
    per = GLOBAL_BATCH // world
    for step in range(start, start + steps):
        x, y = batch("gpt2", step)
        loss_fn("gpt2", model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def save(rank, world, out):
    """Train 2 SGD steps, then save the full (rank 0) and sharded (every rank) state dicts."""
    from xla_fsdp.state_dict import full_state_dict, sharded_state_dict

    model = wrap(CASE, build_model("gpt2"))
    _train(model, rank, world, 2)
    full = full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))
    else:
        assert full == {}
    torch.save(sharded_state_dict(model), os.path.join(out, f"sharded{world}.rank{rank}.pt"))


def resume(rank, world, out, source_world):
    """Load the checkpoint (sharded if same layout, else full) into a fresh model, train 1 step, save full."""
    from xla_fsdp.state_dict import full_state_dict, load_full_state_dict, load_sharded_state_dict

    model = wrap(CASE, build_model("gpt2", seed=123))  # different init: the load must overwrite it
    if source_world == world:
        load_sharded_state_dict(model, torch.load(os.path.join(out, f"sharded{world}.rank{rank}.pt")))
    else:
        load_full_state_dict(model, torch.load(os.path.join(out, "full.pt")))
    _train(model, rank, world, 1, start=2)
    full = full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(out, f"resumed_from{source_world}_on{world}.pt"))
