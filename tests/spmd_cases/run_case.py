"""One SPMD scenario in a fresh process; prints `RESULT <json>` for the test.

SPMD mode is process-global and must be chosen before the runtime starts,
so tests/test_spmd.py runs this file with CPU_NUM_DEVICES set.

  run_case.py train --model mlp|gpt2 [--dtype bf16] [--meta-init]
                    [--gather-params]
  run_case.py checkpoint | errors | partition
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

import torch_xla.runtime as xr

xr.use_spmd()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import xla_fsdp  # noqa: E402
from xla_fsdp.gspmd_engine.engine import apply_spmd_fsdp  # noqa: E402


def shard(model: nn.Module, **options) -> nn.Module:
    """The public front door with engine="spmd" (calls gspmd_engine.engine.apply_spmd_fsdp)."""
    return xla_fsdp.XlaFullyShardedDataParallel(model, engine="spmd", **options)


def compile_count() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def shard_report(model: nn.Module) -> dict:
    report = {}
    for name, param in model.named_parameters():
        spec = torch_xla._XLAC._get_xla_sharding_spec(param)
        shards = xs.xla_sharding.wrap_as_sharded_tensor(param).local_shards if spec else []
        report[name] = {
            "shape": list(param.shape),
            "spec": spec,
            "shard_shapes": [list(s.data.shape) for s in shards],
            "shard_rows": [[s.indices[0].start, s.indices[0].stop] if param.dim() else None for s in shards],
        }
    return report


def meta_init_fn(values: dict, meta_model: nn.Module, calls: list):
    """param_init_fn that fills meta tensors with the given initial values."""
    prefix = {m: n for n, m in meta_model.named_modules()}

    def init(unit: nn.Module) -> None:
        calls.append(prefix[unit])
        for module in unit.modules():
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            if not any(t.is_meta for _, t in own):
                continue
            module.to_empty(device="cpu", recurse=False)
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            with torch.no_grad():
                for name, tensor in own:
                    key = f"{prefix[module]}.{name}".lstrip(".")
                    tensor.copy_(values[key])

    return init


def train_case(args) -> dict:
    # The autograd engine sizes its per-device queues at the first backward;
    # start the XLA runtime (device count) before the eager reference runs one.
    xr.global_runtime_device_count()
    device = torch_xla.device()
    build = models.build_mlp if args.model == "mlp" else functools.partial(models.build_gpt2, vocab=args.vocab)
    policy = models.mlp_policy() if args.model == "mlp" else models.gpt2_policy()
    batches = (
        models.mlp_batches(args.steps) if args.model == "mlp" else models.gpt2_batches(args.steps, vocab=args.vocab)
    )

    model = build()
    reference = models.reference_copy(model)
    initial = {n: t.detach().clone() for n, t in reference.state_dict().items()}
    init_calls: list = []
    param_init_fn = None
    if args.meta_init:
        model = models.TinyMLP(device="meta")
        param_init_fn = meta_init_fn(initial, model, init_calls)
    ref_losses = models.train_eager(reference, args.model, batches)

    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    names_before = [n for n, _ in model.named_parameters()]
    if args.gather_params:
        # Not a front-door keyword (yet): the engine's own entry point.
        model = apply_spmd_fsdp(
            model, compute_dtype=dtype, auto_wrap_policy=policy, param_init_fn=param_init_fn, gather_params=True
        )
    else:
        model = shard(model, compute_dtype=dtype, auto_wrap_policy=policy, param_init_fn=param_init_fn)
    names_after = [n for n, _ in model.named_parameters()]
    shards = shard_report(model)

    opt = torch.optim.AdamW(model.parameters(), lr=models.LR)
    losses, compiles = [], []
    for batch in batches:
        batch = tuple(t.to(device) for t in batch)
        opt.zero_grad()
        loss = models.loss_of(model, args.model, batch)
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(loss.item())
        compiles.append(compile_count())

    ref_params = dict(reference.named_parameters())
    # stored shapes beside the real ones ([Note: padded rows]); the state dict gives the real rows
    stored_rows = {
        n: p.shape[0] for n, p in model.named_parameters() if p.dim() and p.shape[0] != ref_params[n].shape[0]
    }
    padded_rows_max = max(
        (
            float(p.detach()[ref_params[n].shape[0] :].abs().max().cpu())
            for n, p in model.named_parameters()
            if n in stored_rows
        ),
        default=0.0,
    )
    state = model.state_dict()
    state_shapes_same = all(tuple(state[n].shape) == tuple(t.shape) for n, t in reference.state_dict().items())
    param_diff = {}
    diff_sq = update_sq = 0.0
    for name, _ in model.named_parameters():
        got = state[name].detach().cpu()
        want = ref_params[name].detach()
        param_diff[name] = float((got - want).abs().max())
        diff_sq += float(((got - want) ** 2).sum())
        update_sq += float(((want - initial[name]) ** 2).sum())
    # the reference's state dict (real rows) loads into the padded model and reads back the same
    model.load_state_dict(reference.state_dict())
    reloaded = model.state_dict()
    reload_diff = max(float((reloaded[n].detach().cpu() - t).abs().max()) for n, t in reference.state_dict().items())
    return {
        "stored_rows": stored_rows,
        "padded_rows_max": padded_rows_max,
        "state_shapes_same": state_shapes_same,
        "reload_diff": reload_diff,
        "losses": losses,
        "ref_losses": ref_losses,
        "compiles": compiles,
        "param_max_abs_diff": param_diff,
        # ||theta - theta_ref|| / ||theta_ref - theta_0||: error relative to
        # how far training moved the weights.
        "update_rel_err": (diff_sq / update_sq) ** 0.5,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "names_same": names_before == names_after,
        "shards": shards,
        "init_calls": init_calls,
        "devices": xr.global_runtime_device_count(),
    }


def count(hlo: str, needle: str) -> int:
    return hlo.count(needle)


def checkpoint_case(args) -> dict:
    batch = models.gpt2_batches(1)[0]
    device = torch_xla.device()
    results = {}
    grads = {}
    for ckpt in (False, True):
        model = shard(models.build_gpt2(), auto_wrap_policy=models.gpt2_policy(), activation_checkpointing=ckpt)
        ids, labels = (t.to(device) for t in batch)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        named = [(n, p.grad) for n, p in model.named_parameters()]
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([g for _, g in named])
        torch_xla.sync()
        grads[ckpt] = {n: g.cpu() for n, g in named}
        results[str(ckpt)] = {
            "dots": count(hlo, " dot("),
            "opt_barriers": count(hlo, "opt-barrier("),
            "loss": loss.item(),
        }
    results["grad_max_abs_diff"] = max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[True])
    results["grad_max_abs"] = max(float(g.abs().max()) for g in grads[False].values())
    return results


COLLECTIVE = re.compile(
    r"= (\S+) (all-gather|all-reduce|all-to-all|reduce-scatter|"
    r"collective-permute)\("
)


def partition_case(args) -> dict:
    """Compiles GPT-2 training steps and reports the collectives XLA placed.

    The test sets XLA_SAVE_TENSORS_FILE (and XLA_DUMP_POST_OPTIMIZATIONS), so
    torch_xla writes the partitioned, optimized HLO of each compiled graph;
    the training step is the largest module. 8 x 20 = 160 tokens is a size no
    parameter dim has, so a collective over a [.., 160, ..] tensor moves
    activations, not parameters.
    """
    device = torch_xla.device()
    model = shard(models.build_gpt2(), auto_wrap_policy=models.gpt2_policy())
    opt = torch.optim.AdamW(model.parameters(), lr=models.LR)
    for batch in models.gpt2_batches(2, seq=20):
        ids, labels = (t.to(device) for t in batch)
        opt.zero_grad()
        models.loss_of(model, "gpt2", (ids, labels)).backward()
        opt.step()
        torch_xla.sync()
    text = open(os.environ["XLA_SAVE_TENSORS_FILE"] + ".0").read()
    modules = text.split("HloModule ")[1:]
    step = max(modules, key=len)
    return {
        "collectives": [[op, shape] for shape, op in COLLECTIVE.findall(step)],
        "param_shapes": sorted({tuple(p.shape) for p in model.parameters()}),
        "tokens": 8 * 20,
    }


def errors_case(args) -> dict:
    """Misuse is refused with a message naming the fix; buffer_dtype applies."""
    import numpy as np

    out = {}
    model = shard(models.build_mlp(), buffer_dtype=torch.bfloat16)
    out["buffer_dtype"] = str(model.offset.dtype)
    out["param_dtype"] = str(model.head.weight.dtype)
    try:
        shard(model)
    except ValueError as e:
        out["twice"] = str(e)
    n = xr.global_runtime_device_count()
    try:
        shard(models.build_mlp(), mesh=xs.Mesh(np.arange(n), (n,), ("data",)))
    except ValueError as e:
        out["no_fsdp_axis"] = str(e)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["train", "checkpoint", "errors", "partition"])
    parser.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--meta-init", action="store_true")
    parser.add_argument("--gather-params", action="store_true")
    parser.add_argument("--vocab", type=int, default=128)
    args = parser.parse_args()
    result = {"train": train_case, "checkpoint": checkpoint_case, "errors": errors_case, "partition": partition_case}[
        args.case
    ](args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
