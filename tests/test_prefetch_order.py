"""Forward prefetch follows the order units ran in last time; when the order changes (a unit
skipped, as in early-exit or layer-drop models), no gather started for the old order may be
used later: once the parameters change it would hold their old values. XLA world 1,
in process, against the same model unwrapped."""
import copy

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")


class Skippy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x, skip=()):
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = torch.tanh(block(x))
        return x


def _step(model, opt, x, skip, device):
    opt.zero_grad()
    loss = model(x, skip=skip).pow(2).mean()
    loss.backward()
    opt.step()
    torch_xla.sync()
    return loss.item()


def test_a_unit_skipped_this_step_does_not_keep_a_stale_prefetch():
    from xla_fsdp import FSDP

    device = torch_xla.device()
    torch.manual_seed(0)
    plain = Skippy()
    wrapped = copy.deepcopy(plain)
    for i in range(3):
        wrapped.blocks[i] = FSDP(wrapped.blocks[i])
    wrapped = FSDP(wrapped)
    plain = plain.to(device)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, wrapped)]
    x = torch.randn(4, 6).to(device)
    # all blocks (the order is learned), block 2 skipped (block 1 prefetches it anyway), block 2's
    # weights changed in place (as a load or an EMA update would), all blocks again
    for skip in ((), (2,), "change", (), ()):
        if skip == "change":
            with torch.no_grad():
                for m in (plain, wrapped):
                    for p in m.blocks[2].parameters():
                        p.mul_(-1.5)
            continue
        want, got = (_step(m, o, x, skip, device) for m, o in zip((plain, wrapped), opts))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), skip
