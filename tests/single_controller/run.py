"""The collective engine's single-controller runtime in one process with N XLA:CPU devices.

SPMD mode and the device count are fixed when the XLA runtime starts, so
tests/test_single_controller.py runs this file in a fresh process with
CPU_NUM_DEVICES set. Results go to a torch file:

  run.py parity OUT CASE[@STAGES][:IMPL] ...   per-step losses and full parameters of each case
                                      (IMPL: all_gather (default) or all_reduce), and the
                                      unsharded reference's
  run.py program OUT                  the collectives of the partitioned per-device program
                                      (XLA_FLAGS dumps it after SPMD partitioning)
  run.py compiles OUT                 XLA compiles over a 20-step run
  run.py errors OUT                   bad input: messages, and whether the module was touched
  run.py late_spmd OUT                wrap first, turn the SPMD runtime on afterwards
  run.py state_dicts OUT              full and sharded state dicts; deferred init unit by unit
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys

import numpy as np
import torch
import torch.nn as nn
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parity_cases as pc  # noqa: E402
from xla_fsdp import FSDP  # noqa: E402

DEVICES = int(os.environ.get("CPU_NUM_DEVICES", "1"))


def case_for_world(case: pc.Case) -> pc.Case:
    """HYBRID_SHARD's groups are two halves of the devices."""
    if dict(case.fsdp).get("sharding_strategy") != "HYBRID_SHARD":
        return case
    half = DEVICES // 2
    fsdp = dict(case.fsdp, sharding_groups=[list(range(half)), list(range(half, DEVICES))])
    return dataclasses.replace(case, fsdp=tuple(fsdp.items()))


def _count_reduce_scatters(sizes: list) -> None:
    """Record (group size, elements) of every reduce-scatter the engine issues, ("all-gather",
    elements) of every all-gather and ("ring gather", shape) of every ring gather (the real ops
    still run)."""
    issue = torch_xla._XLAC._xla_reduce_scatter

    def counted(*args):
        sizes.append((args[5], args[1].numel()))  # (reduce type, input, token, scale, dim, shard count, ...)
        return issue(*args)

    torch_xla._XLAC._xla_reduce_scatter = counted
    gather = torch_xla._XLAC._xla_all_gather

    def counted_gather(*args):
        sizes.append(("all-gather", args[0].numel()))
        return gather(*args)

    torch_xla._XLAC._xla_all_gather = counted_gather
    from xla_fsdp.collective_engine.ring import TorusRings

    rows = TorusRings.all_gather_rows

    def counted_rows(self, shard, order):  # the ring gathers' buffers, in the shape they travel
        sizes.append(("ring gather", tuple(shard.shape)))
        return rows(self, shard, order)

    TorusRings.all_gather_rows = counted_rows


def parity(names):
    by_name = {c.name: c for c in pc.MATRIX + pc.MIXED_LAYOUTS}
    out = {}
    scatter_sizes: list = []
    _count_reduce_scatters(scatter_sizes)
    for spec in names:
        scatter_sizes.clear()  # each case counts its own (the accumulation cases leave theirs)
        if spec == "meta":  # a meta-device model materialized by reset_parameters()
            import meta_cases

            out[spec] = meta_cases.run(device=torch_xla.device(), sync=torch_xla.sync, global_batch=True)
            continue
        if spec.startswith("acc/"):  # acc/<mode>/<case>: gradient accumulation over 2 micro-batches
            _, mode, name = spec.split("/")
            case = case_for_world(by_name[name])
            size = 2 * DEVICES  # two micro-batches of one sample per device
            ref = pc.train_reference(case, size=size)
            got = pc.train_accumulated(case, 0, 1, mode, device=torch_xla.device(), sync=torch_xla.sync,
                                       global_batch=True, size=size)
            full = {n: pc.unpad(got["shards"][n], p) for n, p in ref["params"].items()}
            out[spec] = {"losses": got["losses"], "ref_losses": ref["losses"], "params": full,
                         "ref_params": ref["params"], "groups": got["groups"],
                         "padded_shapes": {n: list(t.shape) for n, t in got["shards"].items()}}
            continue
        name, _, impl = spec.partition(":")
        name, _, chain = name.partition("+")  # case+CHAIN: that token_chain
        name, _, stages = name.partition("@")  # case@stages: that reduce_scatter_stages
        case = case_for_world(by_name[name])
        if impl:
            case = dataclasses.replace(case, fsdp=case.fsdp + (("all_gather_impl", impl),))
        if stages:
            case = dataclasses.replace(case, fsdp=case.fsdp + (("reduce_scatter_stages", stages),))
        if chain:
            case = dataclasses.replace(case, fsdp=case.fsdp + (("token_chain", chain),))
        ref = pc.train_reference(case)
        got = pc.train_single_controller(case)
        full = {n: pc.unpad(got["padded"][n], p) for n, p in ref["params"].items()}
        shapes = {n: list(t.shape) for n, t in got["padded"].items()}
        out[spec] = {"losses": got["losses"], "ref_losses": ref["losses"], "params": full,
                     "ref_params": ref["params"], "padded_shapes": shapes, "groups": got["groups"],
                     "stacked": got["stacked"],
                     "scatter_sizes": sorted({s for s in scatter_sizes if not str(s[0]).endswith("gather")}),
                     "gathers": sum(1 for s in scatter_sizes if s[0] == "all-gather"),
                     "ring_gathers": sorted({s[1] for s in scatter_sizes if s[0] == "ring gather"}),
                     "scatter_calls": sum(1 for s in scatter_sizes if not str(s[0]).endswith("gather"))}
        scatter_sizes.clear()
    return out


COLLECTIVE = re.compile(r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\((.*)$")


def program():
    """Compile two GPT-2 steps (AdamW, clipping) and read the partitioned program of the step.

    XLA_FLAGS (set by the test) dumps every SyncTensorsGraph right after SPMD
    partitioning; the training step is the module with the reduce-scatters.
    """
    case = pc.Case("program", "gpt2", "adamw", clip=1.0)
    got = pc.train_single_controller(case, steps=2)
    # the second step's program (the steady state; the first step's differs: its root gathers
    # on its own), i.e. the last module compiled that holds the reduce-scatters. Module files
    # are numbered in compile order; glob's order is the file system's, so sort
    dumps = sorted(glob.glob(os.path.join(os.environ["DUMP_DIR"], "*after_spmd-partitioning*.txt")))
    texts = [open(p).read() for p in dumps]
    step = [t for t in texts if " reduce-scatter(" in t][-1]
    found = [COLLECTIVE.search(line) for line in step.splitlines()]
    found = [m for m in found if m]
    groups = [re.search(r"replica_groups=(\{\{[^}]*\}\})", m.group(2)) for m in found]
    model = pc.wrap(case, pc.build_model("gpt2"))
    units = [m for m in model.modules() if getattr(m, "_fsdp_state", None) is not None]
    return {"ops": [m.group(1) for m in found], "units": len(units), "losses": got["losses"],
            "groups": [g.group(1) if g else None for g in groups],
            "pinned": sum("constrain_layout=true" in m.group(2) for m in found)}


def compiles():
    """Compiles counted from before wrapping to the end of step 20 (parameters are not read back)."""
    def count():
        data = met.metric_data("CompileTime")
        return 0 if data is None else int(data[0])

    case = pc.Case("compiles", "gpt2", "adamw", clip=1.0)
    device = torch_xla.device()
    before = count()
    model = pc.wrap(case, pc.build_model("gpt2"))
    opt = pc.make_optimizer(case.optim, model.parameters())
    per_step = []
    for step in range(20):
        x, y = pc.batch("gpt2", step)
        loss = pc.loss_fn("gpt2", model, x.to(device), y.to(device))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        per_step.append(count() - before)
    return {"compiles": per_step[-1], "per_step": per_step, "loss": float(loss.detach().cpu())}


def errors():
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except (ValueError, RuntimeError, TypeError) as e:
            out[key] = str(e)

    def untouched_after(key, build, **kwargs):
        model = build()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        attempt(key, lambda: FSDP(model, **kwargs))
        out[key + "_untouched"] = (type(model) is type(build()) and not hasattr(model, "_fsdp_state")
                                   and shapes == {n: tuple(p.shape) for n, p in model.named_parameters()})

    mlp = lambda: pc.build_model("mlp")  # noqa: E731
    untouched_after("no_fsdp_axis", mlp, mesh=xs.Mesh(np.arange(DEVICES), (DEVICES,), ("data",)))
    untouched_after("groups_overlap", mlp, sharding_strategy="HYBRID_SHARD",
                    sharding_groups=[[0, 1], [1, 2]])
    untouched_after("groups_missing", mlp, sharding_strategy="HYBRID_SHARD",
                    sharding_groups=[list(range(DEVICES // 2))])
    untouched_after("groups_unequal", mlp, sharding_strategy="HYBRID_SHARD",
                    sharding_groups=[[0], list(range(1, DEVICES))])
    untouched_after("sharding_rank", mlp, sharding_rank=0)
    untouched_after("ring_hybrid", mlp, sharding_strategy="HYBRID_SHARD",
                    sharding_groups=[[0, 1], [2, 3]], reduce_scatter_stages="ring")
    model = FSDP(pc.build_model("mlp"))
    x = torch.randn(DEVICES + 1, 32).to(torch_xla.device())
    attempt("batch_not_divisible", lambda: model(x))
    bn = FSDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    attempt("buffer_in_place", lambda: bn(torch.randn(DEVICES, 4).to(torch_xla.device())))
    return out


def state_dicts():
    """Full and sharded state dicts of a trained GPT-2, and a deferred build materialized per unit."""
    import xla_fsdp
    from xla_fsdp.checkpoint import (full_state_dict, load_full_state_dict, load_sharded_state_dict,
                                     sharded_state_dict)

    case = pc.Case("state", "gpt2", "adamw")
    device = torch_xla.device()
    model = pc.wrap(case, pc.build_model("gpt2"))
    opt = pc.make_optimizer(case.optim, model.parameters())
    for step in range(2):
        x, y = pc.batch("gpt2", step)
        pc.loss_fn("gpt2", model, x.to(device), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    full = full_state_dict(model)
    sharded = sharded_state_dict(model)
    x, _ = pc.batch("gpt2", 9)
    logits = model(input_ids=x.to(device)).logits.detach().cpu()

    fresh = pc.wrap(case, pc.build_model("gpt2", seed=1))
    load_full_state_dict(fresh, full)
    again = full_state_dict(fresh)
    fresh2 = pc.wrap(case, pc.build_model("gpt2", seed=2))
    load_sharded_state_dict(fresh2, sharded)
    plain = pc.build_model("gpt2", seed=3)
    plain.load_state_dict(full)
    with torch.no_grad():
        plain_logits = plain(input_ids=x).logits

    # deferred: each unit is materialized right before it is sharded (blocks, then the root);
    # the same order on the host gives the same values
    from transformers import GPT2LMHeadModel

    torch.manual_seed(5)
    deferred = pc.wrap(case, xla_fsdp.deferred_init(GPT2LMHeadModel, pc.gpt2_config()))
    torch.manual_seed(5)
    host = xla_fsdp.deferred_init(GPT2LMHeadModel, pc.gpt2_config())
    inside = {id(m) for block in host.transformer.h for m in block.modules()}
    for block in host.transformer.h:
        xla_fsdp.materialize_module(block)
    xla_fsdp.materialize_module(host, check_fn=lambda m: id(m) not in inside)
    import meta_cases

    # the GSPMD engine returns an XlaFullyShardedDataParallel with the same methods
    gs = FSDP(pc.build_model("mlp"), engine="spmd")
    gx = torch.randn(8, 32).to(device)
    gs(gx).sum().backward()
    with gs.no_sync(), gs.summon_full_params():
        pass
    gspmd = {"is_fsdp": isinstance(gs, FSDP), "name": type(gs).__name__, "module_is_self": gs.module is gs,
             "clip": float(gs.clip_grad_norm_(1e-3)),
             "norm_after": float(torch.stack([p.grad.norm() for p in gs.parameters()]).norm()),
             "mesh": gs.device_mesh is not None}
    try:
        gs.get_shard_metadata()
    except NotImplementedError as e:
        gspmd["metadata"] = str(e)

    meta = {engine: meta_cases.run(device=device, sync=torch_xla.sync, engine=engine, global_batch=True)
            for engine in ("collectives", "spmd")}
    return {"gspmd": gspmd, "meta": meta, "full": full, "again": again, "after_sharded": full_state_dict(fresh2),
            "keys": list(pc.build_model("gpt2").state_dict()), "logits": logits, "plain_logits": plain_logits,
            "deferred": full_state_dict(deferred), "host_per_unit": host.state_dict()}


def late_spmd():
    model = FSDP(pc.build_model("mlp"))  # one process per device: this process is rank 0 of 1
    xr.use_spmd()
    try:
        model(torch.randn(8, 32).to(torch_xla.device()))
    except RuntimeError as e:
        return {"late_spmd": str(e)}
    return {"late_spmd": None}


def main():
    mode, path, *rest = sys.argv[1:]
    if mode != "late_spmd":
        xr.use_spmd()
        # the autograd engine sizes its device queues at the first backward: start the
        # runtime (all devices) before the eager reference runs one
        assert xr.global_runtime_device_count() == DEVICES
    torch_xla.device()
    result = {"parity": lambda: parity(rest), "program": program, "compiles": compiles,
              "errors": errors, "late_spmd": late_spmd, "state_dicts": state_dicts}[mode]()
    torch.save(result, path)


if __name__ == "__main__":
    main()
