"""`optimizer.state_dict()` of the single-controller runtime, in one process with N XLA:CPU devices.

tests/test_single_controller_state_dict.py runs this file in a fresh process with
CPU_NUM_DEVICES set and reads what it saves:

  optimizer_state.py OUT

The model is full_shapes.py's (dim 0 sizes 10, 3, 5, 2001, 288 and a 0-dim scale: padded at 4 devices),
trained with AdamW. Its state dicts (model and optimizer) go into the unwrapped model and a plain
AdamW, and into a fresh wrapped model and optimizer before their first step (a resume); both go
on training beside the original.
"""
from __future__ import annotations

import copy
import sys

import torch
import torch_xla
import torch_xla.runtime as xr

from full_shapes import build, wrap

BEFORE, AFTER = 2, 3  # steps before the state dicts are taken, and after


def batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 288, generator=gen)


def train(model, opt, steps, device=None):
    losses = []
    for step in steps:
        x, y = batch(step)
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device is not None:
            torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
    return losses


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [host(v) for v in value]
    return copy.deepcopy(value)


def shapes(opt_state):
    return {i: {k: list(v.shape) for k, v in s.items() if isinstance(v, torch.Tensor)}
            for i, s in opt_state["state"].items()}


def main(out_path: str) -> None:
    xr.use_spmd()
    device = torch_xla.device()
    out = {}

    model = wrap(build(0))
    opt = adamw(model.parameters())
    train(model, opt, range(BEFORE), device)
    model_state, opt_state = host(model.state_dict()), host(opt.state_dict())
    out["opt_shapes"] = shapes(opt_state)
    out["padded_opt"] = {i: host(opt.state[p]) for i, p in enumerate(model.parameters())}  # what it holds
    out["losses"] = train(model, opt, range(BEFORE, BEFORE + AFTER), device)

    # into the unwrapped model and a plain AdamW
    plain = build(1)
    plain.load_state_dict(model_state)
    plain_opt = adamw(plain.parameters())
    plain_opt.load_state_dict(host(opt_state))  # a copy: torch keeps the loaded "step" tensors and counts on
    out["plain_shapes"] = shapes(host(plain_opt.state_dict()))
    out["plain_losses"] = train(plain, plain_opt, range(BEFORE, BEFORE + AFTER))

    # a plain run's state into a fresh wrapped model and optimizer, before their first step
    plain = build(1)
    plain.load_state_dict(model_state)
    plain_opt = adamw(plain.parameters())
    plain_opt.load_state_dict(host(opt_state))
    fresh = wrap(build(2))
    fresh.load_state_dict(plain.state_dict())
    fresh_opt = adamw(fresh.parameters())
    fresh_opt.load_state_dict(host(plain_opt.state_dict()))
    # until the first step pads and shards it, the loaded state stays on the host (torch_xla moves a
    # tensor to the devices at its first use): no device holds an unpadded, unsharded copy
    out["fresh_on_host"] = {i: {k: "XLAData: None" in torch_xla._XLAC._get_xla_tensor_debug_info(v)
                                for k, v in fresh_opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim()}
                            for i, p in enumerate(fresh.parameters())}
    out["fresh_losses"] = train(fresh, fresh_opt, range(BEFORE, BEFORE + AFTER), device)
    out["fresh_shapes"] = shapes(host(fresh_opt.state_dict()))
    out["fresh_specs"] = {i: {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in fresh_opt.state[p].items()
                              if isinstance(v, torch.Tensor) and v.dim()} for i, p in enumerate(fresh.parameters())}
    out["param_specs"] = {i: torch_xla._XLAC._get_xla_sharding_spec(p) for i, p in enumerate(fresh.parameters())}

    # the padded state the optimizer holds (what state_dict() gave before) still loads
    old = wrap(build(3))
    old.load_state_dict(model_state)
    old_opt = adamw(old.parameters())
    old_opt.load_state_dict(host({"state": out["padded_opt"], "param_groups": opt_state["param_groups"]}))
    out["old_losses"] = train(old, old_opt, range(BEFORE, BEFORE + AFTER), device)
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
