"""scan_layers on the SPMD engine, in a fresh SPMD process (CPU_NUM_DEVICES
set by tests/test_scan_layers.py); prints `RESULT <json>`.

  scan_case.py parity --layers L [--model gpt2|llama] [--dtype bf16] [--ckpt] [--steps N]
  scan_case.py errors
  scan_case.py stored     (the stored stacks: checkpoints, save_pretrained, optimizers)
  scan_case.py random     (dropout inside the loop: per layer, per step, same in the backward)
  scan_case.py both ...   (parity, errors, then stored, in one process)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch_xla.runtime as xr

xr.use_spmd()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch_xla  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import xla_fsdp  # noqa: E402


def gpt2(layers: int, seed: int = 0) -> nn.Module:
    return models.build_gpt2(seed, layers=layers)


def llama(layers: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def llama_policy():
    import functools
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={"LlamaDecoderLayer"})


def shard(model: nn.Module, scan: bool, dtype, ckpt: bool) -> nn.Module:
    is_llama = type(model).__name__.startswith("Llama")
    return xla_fsdp.XlaFullyShardedDataParallel(
        model,
        engine="spmd",
        auto_wrap_policy=llama_policy() if is_llama else models.gpt2_policy(),
        compute_dtype=dtype,
        activation_checkpointing=ckpt,
        scan_layers=scan,
    )


def step_hlo(model: nn.Module, batch) -> str:
    ids, labels = (t.to(torch_xla.device()) for t in batch)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    torch_xla.sync()
    model.zero_grad(set_to_none=True)
    return hlo


def train(model: nn.Module, batches) -> list:
    # SGD with momentum: AdamW divides by sqrt(v), so the rounding noise of
    # GPT-2's key bias (its gradient is mathematically zero) would move it by
    # up to lr in either run, whatever the engine does.
    return _steps(model, _sgd(model), batches)


def parity(args) -> dict:
    xr.global_runtime_device_count()
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    batches = models.gpt2_batches(args.steps)
    build = llama if args.model == "llama" else gpt2
    plain = shard(build(args.layers), False, dtype, args.ckpt)
    scanned = shard(build(args.layers), "per_step" if args.per_step else True, dtype, args.ckpt)
    hlo_plain = step_hlo(plain, batches[0])
    hlo_scan = step_hlo(scanned, batches[0])
    plain_losses = train(plain, batches)
    scan_losses = train(scanned, batches)
    plain_sd = {k: v.cpu() for k, v in plain.state_dict().items()}
    scan_sd = {k: v.cpu() for k, v in scanned.state_dict().items()}
    diffs = {k: float((plain_sd[k] - scan_sd[k]).abs().max()) for k in plain_sd}
    # a checkpoint of the scanned model loads into the plain (unwrapped, CPU) model and computes
    # what the scanned model computes: each stacked layer's rows under that layer's own keys
    fresh = build(args.layers)
    fresh.load_state_dict(scan_sd)
    ids, labels = batches[0]
    with torch.no_grad():
        reload_loss = float(fresh(input_ids=ids, labels=labels).loss)
        scan_loss_now = float(scanned(input_ids=ids.to(torch_xla.device()), labels=labels.to(torch_xla.device())).loss)
    return {
        "plain_losses": plain_losses,
        "scan_losses": scan_losses,
        "param_max_abs_diff": diffs,
        "same_keys": list(plain_sd) == list(scan_sd),
        "reload_loss": reload_loss,
        "scan_loss_now": scan_loss_now,
        "bf16": dtype is not None,
        "while_plain": hlo_plain.count(" while("),
        "while_scan": hlo_scan.count(" while("),
        "dots_plain": hlo_plain.count(" dot("),
        "dots_scan": hlo_scan.count(" dot("),
        "layers_type": type(scanned.model.layers if args.model == "llama" else scanned.transformer.h).__name__,
    }


def caught(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class Odd(nn.Module):
    """Two blocks of different widths in one ModuleList."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([models.Block(8, 8), models.Block(8, 16)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def errors(args) -> dict:
    device = torch_xla.device()
    out = {}
    out["not_identical"] = caught(
        lambda: xla_fsdp.XlaFullyShardedDataParallel(
            Odd(), engine="spmd", auto_wrap_policy=models.mlp_policy(), scan_layers=True
        )
    )
    out["not_wrapped"] = caught(lambda: xla_fsdp.XlaFullyShardedDataParallel(gpt2(2), engine="spmd", scan_layers=True))
    # the collectives engine scans too (tests/test_scan_units.py, tests/test_stored_stacks.py)
    out["collectives_engine"] = caught(
        lambda: xla_fsdp.XlaFullyShardedDataParallel(
            gpt2(2), auto_wrap_policy=models.gpt2_policy(), scan_layers="stacked"
        )
    )
    ids = torch.randint(0, 128, (8, 16)).to(device)
    model = shard(gpt2(2), True, None, False)
    out["use_cache_after_wrap"] = model.config.use_cache
    out["hidden_states"] = caught(lambda: model(input_ids=ids, output_hidden_states=True))
    # generation-style call with a cache runs the layers one by one
    plain = shard(gpt2(2), False, None, False)
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=True).logits.cpu()
        b = plain(input_ids=ids, use_cache=True).logits.cpu()
    out["cache_logits_diff"] = float((a - b).abs().max())
    handle = model.transformer.h[1].register_forward_hook(lambda *a: None)
    out["hook_after_wrap"] = caught(lambda: model(input_ids=ids))
    handle.remove()
    return out


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _steps(model, opt, batches) -> list:
    device = torch_xla.device()
    losses = []
    for batch in batches:
        ids, labels = (t.to(device) for t in batch)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def stored(args) -> dict:
    """What a run with parameters stored stacked keeps: a sharded checkpoint resumes exactly
    and consolidates per layer, save_pretrained writes per-layer keys, Hugging Face's Adafactor
    steps each layer as unscanned, other optimizers with per-tensor statistics are refused."""
    import tempfile

    from transformers import GPT2LMHeadModel
    from transformers.optimization import Adafactor
    from xla_fsdp.checkpoint import consolidate, load_checkpoint, save_checkpoint, save_pretrained

    out = {}
    batches = models.gpt2_batches(4)
    work = tempfile.mkdtemp()
    model = shard(gpt2(3), True, None, False)
    out["stored_shape"] = list(model.transformer.h_scan.attn.c_attn.weight.shape)
    # the Trainer's weight-decay groups: the stored stacks sit in modules of the layers' types
    from transformers import Trainer

    decayed = Trainer.get_decay_parameter_names(None, model)
    plain_decayed = Trainer.get_decay_parameter_names(None, gpt2(3))
    out["decay_same"] = sorted(n.replace("h_scan.", "h.0.") for n in decayed if "h_scan." in n) == sorted(
        n for n in plain_decayed if ".h.0." in n
    )
    out["layer_has_param"] = hasattr(model.transformer.h[0].attn.c_attn, "weight")
    opt = _sgd(model)
    _steps(model, opt, batches[:2])
    at_save = {k: v.cpu() for k, v in model.state_dict().items()}
    save_checkpoint(f"{work}/ckpt", model, opt, step=2)
    out["continued"] = _steps(model, opt, batches[2:])
    again = shard(gpt2(3, seed=1), True, None, False)
    opt2 = _sgd(again)
    load_checkpoint(f"{work}/ckpt", again, opt2)
    out["resumed"] = _steps(again, opt2, batches[2:])
    consolidate(f"{work}/ckpt", f"{work}/hf")
    plain = GPT2LMHeadModel.from_pretrained(f"{work}/hf")
    out["consolidated_diff"] = max(float((plain.state_dict()[k] - at_save[k]).abs().max()) for k in at_save)
    save_pretrained(again, f"{work}/pretrained")
    plain = GPT2LMHeadModel.from_pretrained(f"{work}/pretrained")
    now = {k: v.cpu() for k, v in again.state_dict().items()}
    out["save_pretrained_diff"] = max(float((plain.state_dict()[k] - now[k]).abs().max()) for k in now)
    # [Note: loading across stored stacks]: the stacked checkpoint (with SGD's momentum) into the
    # model without scan goes on as the scanned run; an unscanned run's checkpoint into the scanned
    # model goes on as the unscanned run
    into_plain = shard(gpt2(3, seed=3), False, None, False)
    plain_opt = _sgd(into_plain)
    load_checkpoint(f"{work}/ckpt", into_plain, plain_opt)
    out["into_unscanned"] = _steps(into_plain, plain_opt, batches[2:])
    unscanned = shard(gpt2(3), False, None, False)
    unscanned_opt = _sgd(unscanned)
    _steps(unscanned, unscanned_opt, batches[:2])
    save_checkpoint(f"{work}/plain_ckpt", unscanned, unscanned_opt, step=2)
    out["unscanned_continued"] = _steps(unscanned, unscanned_opt, batches[2:])
    into_scanned = shard(gpt2(3, seed=4), True, None, False)
    scanned_opt = _sgd(into_scanned)
    load_checkpoint(f"{work}/plain_ckpt", into_scanned, scanned_opt)
    out["into_scanned"] = _steps(into_scanned, scanned_opt, batches[2:])
    # another depth is another model, and says why
    out["into_other_depth"] = caught(lambda: load_checkpoint(f"{work}/ckpt", shard(gpt2(2), False, None, False)))
    # a per-layer state dict loads into the stored stacks
    fresh = shard(gpt2(3, seed=2), True, None, False)
    fresh.load_state_dict(at_save)
    out["load_state_dict_diff"] = max(float((v.cpu() - at_save[k]).abs().max()) for k, v in fresh.state_dict().items())
    # [Note: Adafactor on stored stacks]: Adafactor's own defaults (its step scaled by each layer's
    # RMS) with a first moment and weight decay, stored stacks against the unscanned model
    runs = {}
    for scan in (True, False):
        m = shard(gpt2(3), scan, None, False)
        ada = Adafactor(m.parameters(), beta1=0.9, weight_decay=0.01)
        runs[scan] = (_steps(m, ada, batches[:3]), {k: v.cpu() for k, v in m.state_dict().items()})
    out["adafactor_losses"] = [runs[True][0], runs[False][0]]
    # The key bias's gradient is zero but for rounding (softmax ignores a shift shared by a row's
    # scores), and Adafactor's unfactored second moment scales that rounding to a whole step
    # (g / |g| times lr x RMS-scale, 1e-5 here): its sign follows the rounding of either run.
    width = runs[False][1]["transformer.h.0.attn.c_attn.bias"].shape[0] // 3
    diffs, key_bias = {}, 0.0
    for k, v in runs[False][1].items():
        d = (runs[True][1][k] - v).abs()
        if k.endswith("attn.c_attn.bias"):
            key_bias = max(key_bias, float(d[width : 2 * width].max()))
            d = torch.cat([d[:width], d[2 * width :]])
        diffs[k] = float(d.max())
    out["adafactor_param_diff"] = max(diffs.values())
    out["adafactor_key_bias_diff"] = key_bias
    out["adafactor_moved"] = max(
        float((runs[False][1][k] - v.cpu()).abs().max()) for k, v in gpt2(3).state_dict().items() if ".h.1." in k
    )
    out["adafactor_keys_same"] = list(runs[True][1]) == list(runs[False][1])
    out["torch_adafactor"] = caught(lambda: _steps(model, torch.optim.Adafactor(model.parameters()), batches[:1]))
    tied = gpt2(2)
    tied.transformer.h[1].mlp.c_fc.weight = tied.transformer.h[0].mlp.c_fc.weight
    out["shared"] = caught(lambda: shard(tied, True, None, False))
    return out


def stored_adafactor(args) -> dict:
    """[Note: Adafactor on stored stacks] on the GSPMD engine, with its checkpoints: a scanned run's
    (the column factor and RMS per layer on dim 0) goes on in the unscanned model, and the reverse."""
    import tempfile

    from transformers.optimization import Adafactor
    from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint

    def adafactor(m):
        return Adafactor(m.parameters(), lr=1e-3, scale_parameter=False, relative_step=False, weight_decay=0.01)

    batches = models.gpt2_batches(4)
    work = tempfile.mkdtemp()
    out = {}
    for scan in (True, False):
        model = shard(gpt2(3), scan, None, False)
        opt = adafactor(model)
        _steps(model, opt, batches[:2])
        save_checkpoint(f"{work}/{scan}", model, opt, step=2)
        out[f"continued_{scan}"] = _steps(model, opt, batches[2:])
        other = shard(gpt2(3, seed=5), not scan, None, False)
        other_opt = adafactor(other)
        load_checkpoint(f"{work}/{scan}", other, other_opt)
        out[f"across_{scan}"] = _steps(other, other_opt, batches[2:])
    return out


class NoiseLayer(nn.Module):
    """h + dropout(1) * w: the output encodes every layer's keep mask (w_l = 4**l)."""

    def __init__(self, width: int, scale: float, draw: str = "dropout"):
        super().__init__()
        self.w = nn.Parameter(torch.full((width,), scale))
        self.lin = nn.Linear(width, width)  # a matmul, so the layer is an ordinary FSDP unit
        self.draw = draw

    def forward(self, h):
        ones = torch.ones_like(h)
        noise = torch.rand_like(h) if self.draw == "rand" else nn.functional.dropout(ones, 0.5, self.training)
        return h + noise * self.w + 0.0 * self.lin(h)


class NoiseStack(nn.Module):
    def __init__(self, layers: int, width: int, draw: str = "dropout"):
        super().__init__()
        self.layers = nn.ModuleList([NoiseLayer(width, 4.0**i, draw) for i in range(layers)])

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _noise_masks(ckpt: bool, layers: int = 4, width: int = 16, batch: int = 32) -> dict:
    """Two training calls of a scanned NoiseStack: each layer's mask decoded from the output
    (base-4 digits of y/2) against the gradient of its w, which the backward computes from
    the masks it saw (recomputed there when ckpt)."""
    import functools
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    torch.manual_seed(0)
    model = xla_fsdp.XlaFullyShardedDataParallel(
        NoiseStack(layers, width),
        engine="spmd",
        activation_checkpointing=ckpt,
        scan_layers=True,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={NoiseLayer}),
    )
    model.train()
    calls = []
    for _ in range(2):
        y = model(torch.zeros(batch, width, device=torch_xla.device()))
        y.sum().backward()
        torch_xla.sync()
        digits = (y.detach().cpu() / 2).round().long()
        masks = torch.stack([(digits // 4**l) % 2 for l in range(layers)])  # (L, batch, width)
        grad = model.layers_scan.w.grad.cpu()  # stored (width, L)
        model.zero_grad(set_to_none=True)
        expected = 2.0 * masks.sum(1).T.float()  # d sum(y) / d w_l[j] = sum_b 2 m_l[b, j]
        calls.append({"masks": masks, "grad_diff": float((grad - expected).abs().max())})
    first = calls[0]["masks"].float()
    return {
        "grad_diff": max(c["grad_diff"] for c in calls),
        "keep_fraction": float(first.mean()),
        "layers_agree": max(float((first[l] == first[0]).float().mean()) for l in range(1, layers)),
        "steps_agree": float((calls[0]["masks"] == calls[1]["masks"]).float().mean()),
    }


def random(args) -> dict:
    """[Note: dropout under scan]."""
    out = {"masks": _noise_masks(False), "masks_recompute": _noise_masks(True)}
    import functools
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    model = xla_fsdp.XlaFullyShardedDataParallel(
        NoiseStack(2, 16, draw="rand"),
        engine="spmd",
        scan_layers=True,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={NoiseLayer}),
    )
    out["rand_refused"] = caught(lambda: model(torch.zeros(8, 16, device=torch_xla.device())))
    return out


def random_gpt2(args) -> dict:
    """[Note: dropout under scan] in GPT-2: its attention dropout and its own dropouts."""
    out = {}
    # attention dropout goes through the written-out attention: with p 1e-9 it keeps every
    # weight, so the scanned GPT-2 trains as the unscanned one without dropout
    batches = models.gpt2_batches(3)
    plain = shard(gpt2(3), False, None, False)
    keyed = gpt2(3)
    keyed.config.attn_pdrop = 1e-9
    for block in keyed.transformer.h:
        block.attn.attn_dropout.p = 1e-9
    keyed = shard(keyed, True, None, False)
    out["attention_plain"] = train(plain, batches)
    out["attention_keyed"] = train(keyed, batches)
    # GPT-2's own dropouts at 0.1 under scan train (and differ from no dropout)
    dropped = gpt2(3)
    for m in dropped.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.1
    dropped.config.attn_pdrop = 0.1
    out["dropout_losses"] = train(shard(dropped, True, None, True), batches)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["parity", "errors", "stored", "stored_adafactor", "random", "random_gpt2",
                                         "both"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ckpt", action="store_true")
    parser.add_argument("--per-step", action="store_true", help='scan_layers="per_step"')
    args = parser.parse_args()
    if args.case == "both":  # one process for the default run: parity, then the misuse
        result = {"parity": parity(args), "errors": errors(args), "stored": stored(args), "random": random(args)}
    else:
        result = {
            "parity": parity,
            "errors": errors,
            "stored": stored,
            "stored_adafactor": stored_adafactor,
            "random": random,
            "random_gpt2": random_gpt2,
        }[args.case](args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
