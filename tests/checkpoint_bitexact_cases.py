"""A small conv + BatchNorm classifier trained with and without per-unit checkpointing.

The model is torch_xla's FSDP MNIST test's shape (conv, max pool, ReLU, BatchNorm,
linear layers), with every kind of unit a recomputation can get wrong:
- `conv1` takes the batch, which does not require grad: only its parameters do;
- `bn1` sits in the root, between checkpointed units (not recomputed);
- `block` holds a BatchNorm, whose running statistics and `num_batches_tracked`
  its forward updates in place;
- `fc1`, `fc2`: plain linear units.
Every unit but the root is checkpointed (`checkpoint_module` before and after
wrapping, both orders; with `engine="spmd"`, `activation_checkpointing=True`), and
a recomputation must compute exactly what the forward computed: losses, weights
and BatchNorm statistics after `STEPS` steps equal the run without checkpointing
bit for bit (tests/test_checkpoint_bitexact.py).

In-process (world 1, one process per device): `run_pair(...)`. The SPMD runtimes
need a fresh process (the runtime is chosen before the first XLA tensor), as does a
change of XLA_FLAGS:

    checkpoint_bitexact_cases.py world_1|single_controller|spmd OUT
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 30
BATCH = 16  # divides over 4 devices
UNITS = ("conv1", "block", "fc1", "fc2")


class ConvBNNet(nn.Module):
    def __init__(self, track_running_stats: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(8, track_running_stats=track_running_stats)
        self.block = nn.Sequential(nn.Conv2d(8, 16, kernel_size=5),
                                   nn.BatchNorm2d(16, track_running_stats=track_running_stats))
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.bn1(F.relu(F.max_pool2d(self.conv1(x), 2)))
        x = F.relu(F.max_pool2d(self.block(x), 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def batches(steps: int = STEPS):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 1, 28, 28, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen))
            for _ in range(steps)]


def wrap(model: nn.Module, engine: str, checkpoint: bool) -> nn.Module:
    """Nested units for `UNITS` under a root unit; each checkpointed when `checkpoint`.
    engine "none": no FSDP, `UNITS` checkpointed as plain modules."""
    import xla_fsdp
    from xla_fsdp import FSDP

    if engine == "none":  # no FSDP: checkpoint_module on plain modules
        for name in UNITS:
            if checkpoint:
                xla_fsdp.checkpoint_module(getattr(model, name))
        return model
    if engine == "spmd":
        units = {id(getattr(model, name)) for name in UNITS}
        policy = functools.partial(xla_fsdp.wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
        return FSDP(model, engine="spmd", auto_wrap_policy=policy, activation_checkpointing=checkpoint)
    for i, name in enumerate(UNITS):
        sub = getattr(model, name)
        if not checkpoint:
            unit = FSDP(sub)
        elif i % 2 == 0:  # torch_xla's order
            unit = FSDP(xla_fsdp.checkpoint_module(sub))
        else:
            unit = xla_fsdp.checkpoint_module(FSDP(sub))
        setattr(model, name, unit)
    return FSDP(model)


@contextlib.contextmanager
def counting_convolutions():
    """Counts Conv2d forwards (a recomputed one included: it bypasses module hooks)."""
    calls = [0]
    original = nn.Conv2d._conv_forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    nn.Conv2d._conv_forward = counted
    try:
        yield calls
    finally:
        nn.Conv2d._conv_forward = original


def train(device, engine: str = "collectives", checkpoint: bool = False, steps: int = STEPS,
          track_running_stats: bool = True, autocast: bool = False) -> Dict:
    """Losses and the state dict (on the host) after `steps` SGD steps."""

    torch.manual_seed(1)
    model = ConvBNNet(track_running_stats).to(device)
    model = wrap(model, engine, checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    losses: List[torch.Tensor] = []
    with counting_convolutions() as calls:
        for x, y in batches(steps):
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            with torch.autocast("xla", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            loss = F.nll_loss(out.float(), y)
            loss.backward()
            opt.step()
            if device.type == "xla":
                import torch_xla

                torch_xla.sync()
            losses.append(loss.detach().cpu())
    return {"losses": torch.stack(losses), "conv_calls": calls[0],
            "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def run_pair(device, **kwargs) -> Dict:
    """The same training without and with checkpointing."""
    return {"plain": train(device, checkpoint=False, **kwargs), "checkpointed": train(device, checkpoint=True, **kwargs)}


def differences(pair: Dict) -> List[str]:
    """What differs between the two runs (empty: bit-identical), with the largest difference."""
    plain, ckpt = pair["plain"], pair["checkpointed"]
    out = []
    if not torch.equal(plain["losses"], ckpt["losses"]):
        steps = (plain["losses"] != ckpt["losses"]).nonzero().flatten().tolist()
        out.append(f"losses from step {steps[0]}, max {(plain['losses'] - ckpt['losses']).abs().max().item():.3g}")
    for key, want in plain["state"].items():
        got = ckpt["state"][key]
        if not torch.equal(got, want):
            out.append(f"{key} max {(got.double() - want.double()).abs().max().item():.3g}")
    return out


def main():
    runtime, out = sys.argv[1:]
    import torch_xla
    import torch_xla.runtime as xr

    if runtime != "world_1":
        xr.use_spmd()  # one process drives the 4 devices
    device = torch_xla.device()
    engine = "spmd" if runtime == "spmd" else "collectives"
    # the single controller refuses a forward that updates a buffer in place (each device would
    # update its own copy; ManualRegion), so there BatchNorm normalizes with the batch's statistics
    # and keeps none. (Eval mode, running statistics read but not updated, is no way out: torch_xla
    # 2.9's batch-norm backward fails in eval mode, with or without FSDP.)
    kwargs = {"engine": engine, "track_running_stats": runtime != "single_controller"}
    torch.save(run_pair(device, **kwargs), out)


if __name__ == "__main__":
    main()
