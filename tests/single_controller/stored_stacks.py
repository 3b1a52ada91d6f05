"""scan_layers' stored stacks on the collectives engine, in one process with N XLA:CPU devices
([Note: the collectives engine's stored stacks]).

tests/test_stored_stacks.py runs this file in a fresh process with CPU_NUM_DEVICES set and reads
what it saves:

  stored_stacks.py OUT

A stack of three blocks whose rows 4 devices do not divide (10-row weights and biases: 3 a
device, padded to 12), a buffer per layer, trained with AdamW and clipping: scanned with stored
stacks, with "per_step" and unscanned, from the same initial weights.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch_xla
import torch_xla.runtime as xr


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 10)
        self.norm = nn.LayerNorm(10)
        self.down = nn.Linear(10, 16)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 16))

    def forward(self, h):
        return h + self.down(torch.tanh(self.norm(self.up(h)))) * self.gain


class Net(nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build(scan, seed: int = 0) -> nn.Module:
    import xla_fsdp
    from xla_fsdp import FSDP

    torch.manual_seed(seed)
    model = Net().to(torch_xla.device())
    return FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy([Block]), scan_layers=scan,
                auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw))


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g).to(torch_xla.device()), torch.randn(8, 4, generator=g).to(torch_xla.device())


def train(model, opt, steps, start=0):
    losses, norms = [], []
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        norms.append(model.clip_grad_norm_(0.5))
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        losses.append(loss.detach())
    return [float(l.cpu()) for l in losses], [float(n.cpu()) for n in norms]


def host(state) -> dict:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def on_host(obj):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t, obj)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def generate() -> dict:
    """A call with a KV cache runs the layers one by one: each gathers its column of the stacks
    (and under summon_full_params reads the whole stacks'); greedy tokens and logits."""
    import xla_fsdp
    from transformers import GPT2Config, GPT2LMHeadModel
    from xla_fsdp import FSDP
    from xla_fsdp.collective_engine.manual_region import steer_is_tracing

    steer_is_tracing()
    ids = (torch.arange(32).reshape(4, 8) % 64).to(torch_xla.device())
    out = {}
    for scan in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                           bos_token_id=0, eos_token_id=0))
        model = FSDP(model.to(torch_xla.device()), auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                     auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw),
                     scan_layers=scan).eval()
        with torch.no_grad():
            out[f"logits_{scan}"] = model(input_ids=ids, use_cache=True).logits.cpu()
            out[f"tokens_{scan}"] = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0).cpu()
            with model.summon_full_params():
                out[f"summoned_{scan}"] = model(input_ids=ids, use_cache=True).logits.cpu()
    return out


class ScaledBlock(Block):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, h):
        return super().forward(h) * self.scale


class TiedBlock(Block):
    def __init__(self):
        super().__init__()
        self.back = nn.Linear(10, 16)
        self.back.weight = self.down.weight


def refusals() -> dict:
    """What stored stacks cannot hold is refused at wrap time, naming "per_step"; "per_step" takes it."""
    import xla_fsdp
    from xla_fsdp import FSDP

    out = {}
    for name, block in (("scalar", ScaledBlock), ("tied", TiedBlock)):
        for scan in (True, "per_step"):
            model = Net()
            model.layers = nn.ModuleList(block() for _ in range(3))
            model = model.to(torch_xla.device())
            for layer in model.layers:  # Module.to() unties (each module gets its own copy): tie again
                if hasattr(layer, "back"):
                    layer.back.weight = layer.down.weight
            try:
                FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy([block]),
                     auto_wrapper_callable=lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw), scan_layers=scan)
                out[(name, scan)] = None
            except ValueError as e:
                out[(name, scan)] = str(e)
    return out


def resumed(stored, opt, make_opt):
    """A fresh scanned model and optimizer given `stored`'s and `opt`'s state dicts, the optimizer's as
    read from a file (no tensor shared)."""
    model = build(True, seed=7)
    model.load_state_dict(stored.state_dict())
    model_opt = make_opt(model)
    train(model, model_opt, 1, start=50)  # creates the optimizer's state, then overwritten
    model.load_state_dict(stored.state_dict())
    model_opt.load_state_dict(on_host(opt.state_dict()))
    return model, model_opt


def loaded(path, scan, seed, make_opt):
    """A model (scanned or not) and optimizer loaded from xla_fsdp.checkpoint `path`."""
    from xla_fsdp.checkpoint import load_checkpoint

    model = build(scan, seed=seed)
    model_opt = make_opt(model)
    load_checkpoint(path, model, model_opt)
    return model, model_opt


def adafactor(model):
    from transformers.optimization import Adafactor

    return Adafactor(model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False, weight_decay=0.01)


def adafactor_runs() -> dict:
    """[Note: Adafactor on stored stacks]: HF Trainer's Adafactor on the stored stacks against the
    unscanned model; its state resumes through optimizer.state_dict() (the row factor's padding cut
    and put back) and through xla_fsdp.checkpoint, and loads across the two layouts."""
    from xla_fsdp.checkpoint import save_checkpoint

    out, runs = {}, {}
    for scan in (True, False):
        model = build(scan)
        opt = adafactor(model)
        losses, _ = train(model, opt, 3)
        runs[scan] = (model, opt)
        out[f"losses_{scan}"] = losses
        out[f"state_{scan}"] = host(model.state_dict())
    stored, opt = runs[True]
    out["optim_shapes"] = {k: tuple(v.shape) for k, v in opt.state_dict()["state"][2].items()
                           if isinstance(v, torch.Tensor)}  # layers_scan.up.weight
    again, again_opt = resumed(stored, opt, adafactor)
    out["resume"] = [train(stored, opt, 2, start=3)[0], train(again, again_opt, 2, start=3)[0]]
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(os.path.join(tmp, "ckpt"), stored, opt, step=5)
        other, other_opt = loaded(path, True, 9, adafactor)
        into_plain, into_plain_opt = loaded(path, False, 11, adafactor)
        out["checkpoint"] = [train(stored, opt, 2, start=5)[0], train(other, other_opt, 2, start=5)[0],
                             train(into_plain, into_plain_opt, 2, start=5)[0]]
        # an unscanned run's checkpoint (each layer's RMS a number) into the stored stacks
        plain, plain_opt = runs[False]
        plain_path = save_checkpoint(os.path.join(tmp, "plain"), plain, plain_opt, step=3)
        into_stored, into_stored_opt = loaded(plain_path, True, 13, adafactor)
        out["into_stored"] = [train(plain, plain_opt, 2, start=3)[0], train(into_stored, into_stored_opt, 2, start=3)[0]]
    return out


def main(out: str) -> None:
    xr.use_spmd()
    res = {}
    runs = {}
    for scan in (True, "per_step", False):
        model = build(scan)
        opt = adamw(model)
        losses, norms = train(model, opt, 3)
        runs[scan] = (model, opt)
        res[str(scan)] = {"losses": losses, "norms": norms, "state": host(model.state_dict()),
                          "params": {n: list(p.shape) for n, p in model.named_parameters()}}
    stored, opt = runs[True]
    res["metadata"] = {k: (v["shape"], v["rows"]) for k, v in stored.get_shard_metadata()["shard_info"].items()}
    res["optim_shapes"] = sorted(tuple(t.shape) for s in opt.state_dict()["state"].values()
                                 for t in s.values() if isinstance(t, torch.Tensor) and t.dim())

    # the unscanned model's state dict into a scanned one (other initial weights), and the reverse;
    # each goes on training like the model it was loaded from
    plain, plain_opt = runs[False]
    into_stored = build(True, seed=7)
    into_stored.load_state_dict(plain.state_dict())
    res["loaded_into_stored"] = host(into_stored.state_dict())
    into_plain = build(False, seed=7)
    into_plain.load_state_dict(stored.state_dict())
    res["loaded_into_plain"] = host(into_plain.state_dict())
    res["after_load"] = {"stored": train(into_stored, adamw(into_stored), 2, start=3)[0],
                         "plain": train(into_plain, adamw(into_plain), 2, start=3)[0]}

    # resume: model and optimizer state dicts into a fresh scanned model, two more steps each
    again, again_opt = resumed(stored, opt, adamw)
    res["resume"] = {"original": train(stored, opt, 2, start=3)[0], "resumed": train(again, again_opt, 2, start=3)[0]}

    # xla_fsdp.checkpoint: saved from the scanned model, loaded into another, consolidated per layer
    from xla_fsdp.checkpoint import consolidate, save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(os.path.join(tmp, "ckpt"), stored, opt, step=5)
        other, other_opt = loaded(path, True, 9, adamw)
        # [Note: loading across stored stacks]: into the model without scan (AdamW's state too)
        into_plain, into_plain_opt = loaded(path, False, 11, adamw)
        res["checkpoint"] = {"saved": host(stored.state_dict()), "loaded": host(other.state_dict()),
                             "after": [train(stored, opt, 2, start=5)[0], train(other, other_opt, 2, start=5)[0]],
                             "into_plain": train(into_plain, into_plain_opt, 2, start=5)[0]}
        # and an unscanned run's checkpoint into the scanned model
        plain_path = save_checkpoint(os.path.join(tmp, "plain_ckpt"), plain, plain_opt, step=3)
        into_stored, into_stored_opt = loaded(plain_path, True, 13, adamw)
        res["checkpoint"]["into_stored"] = [train(plain, plain_opt, 2, start=3)[0],
                                            train(into_stored, into_stored_opt, 2, start=3)[0]]
        from safetensors.torch import load_file

        res["consolidated"] = host(load_file(consolidate(path, os.path.join(tmp, "full"))))

    res["generate"] = generate()
    res["refusals"] = refusals()

    res["adafactor"] = adafactor_runs()
    torch.save(res, out)


if __name__ == "__main__":
    main(sys.argv[1])
