"""A model built under torch.device("meta") and wrapped without param_init_fn: each unit gets
storage and its modules' reset_parameters() (FSDP's default). Shared by tests/test_meta_init.py
(XLA world 1, gloo world 2) and the single-controller worker (both engines, 4 devices)."""
import torch
import torch.nn as nn

import parity_cases as pc  # noqa: F401 (its import puts bench/ on sys.path for a worker that imports this file alone)


class TiedNet(nn.Module):
    """Wide enough for stable statistics; an embedding tied to the output head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 64)
        self.blocks = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


def stats(state):
    return {k: (float(v.float().mean()), float(v.float().std()), v.numel()) for k, v in state.items() if v.numel() > 1}


def run(device=None, sync=None, world=1, rank=0, engine="collectives", global_batch=False):
    """-> {"eager": stats, "meta": stats, "losses": [...], "tied": bool}"""
    from xla_fsdp import FSDP

    torch.manual_seed(0)
    eager = TiedNet()
    with torch.device("meta"):
        model = TiedNet()
    kwargs = {"engine": "spmd"} if engine == "spmd" else {}
    model.blocks = FSDP(model.blocks, **kwargs) if engine != "spmd" else model.blocks
    model = FSDP(model, **kwargs)
    if engine == "spmd":
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        tied = model.head.weight is model.emb.weight
    else:
        from xla_fsdp.checkpoint import full_state_dict

        state = full_state_dict(model, rank0_only=False)
        tied = state["head.weight"] is state["emb.weight"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(8):
        gen = torch.Generator().manual_seed(step % 2)
        ids = torch.randint(0, 300, (8, 4), generator=gen)
        if not global_batch:
            ids = ids[rank * 8 // world:(rank + 1) * 8 // world]
        if device is not None:
            ids = ids.to(device)
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, 300), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sync is not None:
            sync()
        losses.append(float(loss.detach().cpu()))
    return {"eager": stats(eager.state_dict()), "meta": stats(state), "losses": losses, "tied": tied}


def check(got):
    assert got["tied"], "the tied embedding and head came apart"
    assert got["losses"][-1] < got["losses"][0] - 0.5, got["losses"]  # it trains
    # two independent draws of n values: 4 standard errors of the difference (constants: exactly equal)
    for key, (mean, std, n) in got["eager"].items():
        m_mean, m_std, _ = got["meta"][key]
        assert abs(m_mean - mean) <= 4 * std * (2 / n) ** 0.5 + 1e-6, (key, m_mean, mean)
        assert abs(m_std - std) <= 4 * std * (1 / n) ** 0.5 + 1e-6, (key, m_std, std)
