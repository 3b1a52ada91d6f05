"""`model.state_dict()` of the single-controller runtime, in one process with N XLA:CPU devices.

tests/test_single_controller_state_dict.py runs this file in a fresh process
with CPU_NUM_DEVICES set (SPMD mode and the device count are fixed when the
runtime starts) and reads what it saves:

  full_shapes.py OUT

The model has dim 0 sizes that the device count does not divide (10, 3, 5,
2001 and a 0-dim scale at 4 devices), weights stored in whole 16-row tiles
([Note: shards in whole tiles]: 2001 rows as 4 x 512; 288 rows, 72 a
device, stay), a nested unit, and a unit that is torch's CheckpointWrapper
(whose own hook renames its keys).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch_xla
import torch_xla.runtime as xr


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.scale


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 10), nn.ReLU(), Scale(), nn.Linear(10, 3), nn.Linear(3, 5), nn.Linear(5, 2001),
                         nn.Linear(2001, 288))


def wrap(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from xla_fsdp import FSDP

    model[3] = FSDP(model[3])
    model[4] = FSDP(checkpoint_wrapper(model[4]))
    return FSDP(model)


def host(state) -> dict:
    return {k: v.detach().cpu() for k, v in state.items()}


def main(out_path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from xla_fsdp.checkpoint import consolidate_sharded_state_dicts, full_state_dict

    xr.use_spmd()
    device = torch_xla.device()
    x = torch.randn(8, 16)

    model = wrap(build(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x.to(device)).sum().backward()  # one step: the state dict must follow the parameters
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
    out = {"plain_keys": list(build(0).state_dict()),
           "plain_shapes": {k: list(v.shape) for k, v in build(0).state_dict().items()},
           "param_shapes": {n: list(p.shape) for n, p in model.named_parameters()},
           "shardings": [torch_xla._XLAC._get_xla_sharding_spec(p) for p in model.parameters()]}
    state = host(model.state_dict())
    out["state"] = state
    out["gathered"] = full_state_dict(model, rank0_only=False)
    # the padded global tensors by state-dict key (no buffers, no ties: one parameter per key, same order)
    out["padded"] = padded = dict(zip(state, [p.detach().cpu() for p in model.parameters()]))
    assert len(padded) == len(state)
    out["logits"] = model(x.to(device)).detach().cpu()

    # into the unwrapped model, strictly
    plain = build(1)
    out["plain_load"] = str(plain.load_state_dict(state, strict=True))
    with torch.no_grad():
        out["plain_logits"] = plain(x)

    # back into a wrapped model: the full state dict, and a padded one (what state_dict() gave before)
    fresh = wrap(build(2))
    out["fresh_load"] = str(fresh.load_state_dict(state, strict=True))
    torch_xla.sync()
    out["fresh_padded"] = dict(zip(state, [p.detach().cpu() for p in fresh.parameters()]))
    out["fresh_param_shapes"] = {n: list(p.shape) for n, p in fresh.named_parameters()}
    out["fresh_shardings"] = [torch_xla._XLAC._get_xla_sharding_spec(p) for p in fresh.parameters()]
    out["fresh_logits"] = fresh(x.to(device)).detach().cpu()
    old = wrap(build(3))
    old.load_state_dict(padded, strict=True)
    out["old_padded"] = dict(zip(state, [p.detach().cpu() for p in old.parameters()]))

    # torch.distributed.checkpoint's get_state_dict (model side), and torch_xla's per-rank flow
    out["dcp_model"] = host(get_state_dict(model, opt)[0])
    out["consolidated"] = dict(consolidate_sharded_state_dicts([state], model.get_shard_metadata()))

    # the GSPMD engine, for comparison: its state dict has the unwrapped shapes
    from xla_fsdp import FSDP

    gspmd = FSDP(build(0), engine="spmd")
    out["gspmd_shapes"] = {k: list(v.shape) for k, v in gspmd.state_dict().items()}
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
