"""Backward with autograd's multithreading off records the same step as with it on.

The TPU check turns autograd's multithreading off where one traced process stands in
for 128 chips or more ([Note: 128 chips and up in one traced process] in
xla_fsdp/aot/child.py). tests/test_aot.py runs this file in a fresh process with
CPU_NUM_DEVICES set and compares what it prints:

  serial_backward.py

One single-controller step (nested units, a checkpointed unit, mixed precision) is
traced after a first step, with multithreading on, off, and on again; the gradients'
HLO of each is printed as JSON.
"""
from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch_xla
import torch_xla.runtime as xr


def step_hlo(model: nn.Module, x: torch.Tensor, multithreading: bool) -> str:
    for p in model.parameters():
        p.grad = None
    with torch.autograd.set_multithreading_enabled(multithreading):
        model(x).float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "a parameter got no gradient"
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    torch_xla.sync()  # run it, so the next step starts from materialized state
    return hlo


def main() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from xla_fsdp import FSDP, MixedPrecision

    xr.use_spmd()
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 10))
    bf16 = MixedPrecision(compute_dtype=torch.bfloat16)
    model[2] = FSDP(checkpoint_wrapper(model[2]), mixed_precision=bf16)
    model[4] = FSDP(model[4], mixed_precision=bf16)
    model = FSDP(model, mixed_precision=bf16)
    x = torch.randn(8, 16).to(device)
    step_hlo(model, x, True)  # the first step also runs the engine's lazy set-up
    steps = {"threaded": step_hlo(model, x, True), "serial": step_hlo(model, x, False),
             "threaded_again": step_hlo(model, x, True)}
    print(json.dumps({**steps, "devices": xr.global_runtime_device_count()}))


if __name__ == "__main__":
    main()
