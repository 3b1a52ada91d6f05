"""One model trained under a recomputation policy ([Note: recomputation policies]), for
tests/test_remat_policies*.py: `run(engine, policy, scan, model)` gives the losses of 3 AdamW steps,
the first step's gradients, the parameters after them and the number of dots in the first step's
program. As a script: `gspmd` runs the GSPMD engine's cases in this (SPMD) process and prints their
differences to "full"; `hlo` traces the offloaded policies for a TPU (XLA_FSDP_AOT=1) and prints
how many host moves each step program holds."""
from __future__ import annotations

import json
import re
import sys

import torch

STEPS = 3


def _model(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), "GPT2Block"
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg), "LlamaDecoderLayer"


def _wrapped(engine: str, policy: str, scan: bool, model: str):
    import torch_xla

    import xla_fsdp
    from xla_fsdp import FSDP

    module, layer = _model(model)
    kw = dict(auto_wrap_policy=xla_fsdp.wrap.transformer_policy([layer]), scan_layers=scan, remat_policy=policy)
    if engine == "spmd":
        kw.update(engine="spmd", activation_checkpointing=True)
    else:
        kw.update(auto_wrapper_callable=lambda m, **k: FSDP(xla_fsdp.checkpoint_module(m), **k))
    module = module.to(torch_xla.device())
    module.tie_weights()  # Module.to() on torch_xla unties GPT-2's embeddings
    return FSDP(module, **kw)


def _loss(model, step: int):
    import torch_xla

    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step)).to(torch_xla.device())
    return model(input_ids=ids, labels=ids).loss


def _sync() -> None:
    """Run the pending graph and wait for it: one execution in flight per device. Two in flight (the step's and
    the next transfer's) on 4 XLA:CPU devices over 2 cores can starve the CPU client's pool, whose threads then
    block in one program's collectives while another device still needs a thread (../shared/notes/xla-on-cpu.md:
    a CI run aborted on "Termination timeout" for an all-to-all and an all-reduce waited on at once)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def run(engine: str, policy: str, scan: bool, model: str = "llama") -> dict:
    import torch_xla

    net = _wrapped(engine, policy, scan, model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-4)
    out = {"losses": []}
    for step in range(STEPS):
        loss = _loss(net, step)
        loss.backward()
        if step == 0:
            grads = [p.grad for p in net.parameters() if p.grad is not None]
            out["dots"] = len(re.findall(r" dot\(", torch_xla._XLAC._get_xla_tensors_hlo(grads)))
            _sync()
            out["grads"] = {n: p.grad.detach().cpu() for n, p in net.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        _sync()
        out["losses"].append(float(loss.detach()))
    out["params"] = {n: p.detach().cpu() for n, p in net.named_parameters()}
    return out


def placements(hlo: str) -> dict:
    """How many annotate_device_placement calls move to the host and back in `hlo`."""
    calls = [line for line in hlo.splitlines() if "annotate_device_placement" in line]
    return {"pinned_host": sum('_xla_buffer_placement="pinned_host"' in c for c in calls),
            "device": sum('_xla_buffer_placement="device"' in c for c in calls)}


def _traced_moves(engine: str, policy: str, scan: bool) -> dict:
    import torch_xla

    net = _wrapped(engine, policy, scan, "llama")
    _loss(net, 0).backward()
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    return placements(torch_xla._XLAC._get_xla_tensors_hlo(grads))  # traced only: nothing runs


def _diff(got: dict, ref: dict) -> dict:
    def worst(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in b)

    return {"losses": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
            "grads": worst(got["grads"], ref["grads"]), "params": worst(got["params"], ref["params"]),
            "dots": got["dots"], "full_dots": ref["dots"]}


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    result = {}
    if what == "hlo":
        for scan, policy in ((True, "minimal_offloaded"), (True, "full_offloaded"), (False, "qkv_proj_offloaded"),
                             (False, "full")):
            result[f"{'scan' if scan else 'unscanned'} {policy}"] = _traced_moves(rest[0] if rest else "collectives",
                                                                                   policy, scan)
    else:  # gspmd [scan|unscanned]:policy[:model] ...
        refs = {}
        for case in rest:
            where, policy, *model = case.split(":")
            key = (where == "scan", model[0] if model else "llama")
            if key not in refs:
                refs[key] = run("spmd", "full", *key)
            result[case] = _diff(run("spmd", policy, *key), refs[key])
    print("RESULT " + json.dumps(result), flush=True)
