"""FSDP2's API on XLA (xla_fsdp.fsdp) in one process driving N XLA:CPU devices.

Run by tests/test_fsdp2.py in a fresh process (CPU_NUM_DEVICES fixes the device count when the
runtime starts); writes what it observed as JSON:

  api_cases.py errors OUT    bad input: each case's exception type and message, and whether the
                             module was left as it was
  api_cases.py methods OUT   FSDPModule's methods and ShardedParameter's attributes, each compared
                             with what the unsharded model computes
  api_cases.py doors OUT     what each front door makes of a module (isinstance, units, policies)
  api_cases.py ignored OUT   ignored_params: left out of the unit, loss and gradients as unsharded
  api_cases.py grouped OUT   fully_shard([emb, head]): one unit of two modules, trained as unsharded
  api_cases.py tied OUT      a GPT-2 moved to the device before fully_shard: re-tied, trained as tied
  api_cases.py cuts OUT      graph cuts and compiles per step of a loop with no torch_xla.sync()
                             and of one that syncs after each step ([Note: the step cut])
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import xla_fsdp.fsdp as fsdp  # noqa: E402
from xla_fsdp.fsdp import FSDPModule, fully_shard  # noqa: E402
from xla_fsdp.unit_state import state_of  # noqa: E402


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self, d=8, vocab=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def sharded_net(seed=0, **kw):
    torch.manual_seed(seed)
    net = Net()
    for b in net.blocks:
        fully_shard(b, **kw)
    fully_shard(net, **kw)
    return net


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return {"type": type(e).__name__, "message": str(e)}
    return None


def errors(out):
    res = {}
    net = sharded_net()
    res["twice"] = _error(lambda: fully_shard(net.blocks[0]))

    parent = Net()
    fully_shard(parent)
    res["child_after_parent"] = _error(lambda: fully_shard(parent.blocks[1]))
    res["child_after_parent_untouched"] = not isinstance(parent.blocks[1], FSDPModule)

    from torch.distributed.device_mesh import DeviceMesh

    bad_mesh = DeviceMesh("xla", torch.arange(3), _init_backend=False)
    fresh = Block()
    res["mesh"] = _error(lambda: fully_shard(fresh, mesh=bad_mesh))
    res["mesh_untouched"] = type(fresh) is Block and type(fresh.a.weight) is nn.Parameter
    from torch.distributed.device_mesh import init_device_mesh

    res["mesh_3d"] = _error(lambda: fully_shard(fresh, mesh=init_device_mesh("xla", (2, 2, 1))))
    res["hsdp_replicate_not_dividing"] = _error(lambda: fully_shard(fresh, mesh=init_device_mesh("xla", (3, 1))))
    res["hsdp_untouched"] = type(fresh) is Block and type(fresh.a.weight) is nn.Parameter

    from torch.distributed.tensor import Shard

    res["placement"] = _error(lambda: fully_shard(Block(), shard_placement_fn=lambda p: Shard(1)))
    res["placement_dim0_ok"] = _error(lambda: fully_shard(Block(), shard_placement_fn=lambda p: Shard(0))) is None
    res["ignored_params"] = _error(lambda: fully_shard(Block(), ignored_params={nn.Parameter(torch.ones(1))}))
    res["reshard_int"] = _error(lambda: fully_shard(Block(), reshard_after_forward=3))
    res["cast_inputs"] = _error(lambda: fully_shard(Block(), mp_policy=fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, cast_forward_inputs=False)))
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload, MixedPrecisionPolicy as TorchMP

    theirs = fully_shard(Block(), mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                    output_dtype=torch.float16),
                         offload_policy=TorchOffload())
    opts = state_of(theirs).options.mixed_precision
    with torch.no_grad():
        y = theirs(torch.randn(8, 8, device=torch_xla.device()))
    res["torch_policies"] = {"compute": str(opts.compute_dtype), "reduce": str(opts.reduce_dtype),
                             "offloaded": state_of(theirs).offload is not None,
                             "param_device": theirs.a.weight.device.type, "output": str(y.dtype)}
    res["module_list"] = _error(lambda: fully_shard(nn.ModuleList([Block()])))

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    on_xla = Block().to(torch_xla.device())
    res["torch_fully_shard"] = _error(lambda: torch_fully_shard(on_xla))

    with torch.device("meta"):
        meta = Net()
    for b in meta.blocks:
        fully_shard(b)
    fully_shard(meta)
    tokens = torch.randint(0, 10, (8, 4), device=torch_xla.device())
    res["meta_forward"] = _error(lambda: meta(tokens))

    wrong = {k: v.full_tensor().cpu() for k, v in net.state_dict().items()}
    wrong["head.weight"] = torch.zeros(11, 8)
    before = net.head.weight.full_tensor().detach().cpu().clone()
    res["load_shapes"] = _error(lambda: net.load_state_dict(wrong))
    res["load_shapes_untouched"] = bool(torch.equal(before, net.head.weight.full_tensor().detach().cpu()))
    _write(out, res)


def _write(out, res):
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def _grads_of(model, tokens, targets):
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss


def _reference():
    """A batch, the unsharded Net (seed 0) and a copy of its state dict."""
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 10, (8, 4)), torch.randint(0, 10, (8, 4))
    ref = Net()
    return tokens, targets, ref, {k: v.clone() for k, v in ref.state_dict().items()}


def methods(out):
    dev = torch_xla.device()
    res = {}
    tokens, targets, ref, state = _reference()
    net = sharded_net()
    net.load_state_dict(state)
    p = net.head.weight
    res["param"] = {
        "class": type(p).__name__, "placements": [str(x) for x in p.placements],
        "mesh_size": p.device_mesh.size(), "mesh_type": p.device_mesh.device_type,
        "full_shape": list(p.full_shape), "full_tensor_shape": list(p.full_tensor().shape),
        "full_tensor_equal": bool(torch.equal(p.full_tensor().detach().cpu(), state["head.weight"])),
        "isinstance": isinstance(net, FSDPModule) and isinstance(net.blocks[0], FSDPModule),
        "state_dict_shapes_ok": all(tuple(v.shape) == tuple(state[k].shape) for k, v in net.state_dict().items()),
    }
    from torch.distributed.tensor import DTensor

    # DTensor's semantics: the global shape whatever the padding (head.weight's 10 rows at 4 devices: 12 stored)
    res["dtensor"] = {"shape": list(p.shape), "size": list(p.size()), "size0": p.size(0), "numel": p.numel(),
                      "len": len(p), "to_local": list(p.to_local().shape), "stored": list(torch.Tensor.size(p)),
                      "is_dtensor": isinstance(p, DTensor), "is_parameter": isinstance(p, nn.Parameter),
                      "grad_flows": None}
    loss = net(tokens.to(dev)).float().sum()
    loss.backward()
    res["dtensor"]["grad_flows"] = list(p.grad.shape)
    net.zero_grad(set_to_none=True)
    # unshard() under no_grad: the parameters registered whole, the output that of the unsharded model
    net.unshard()
    registered = net.head.weight
    res["unshard_registers_whole"] = list(registered.shape) == list(state["head.weight"].shape) \
        and not isinstance(registered, fsdp.ShardedParameter)
    with torch.no_grad():
        got = net(tokens.to(dev)).cpu()
    net.reshard()
    with torch.no_grad():
        want = ref(tokens)
    res["unshard_forward_diff"] = float((got - want).abs().max())
    # FSDP2's unshard() under a bf16 MixedPrecisionPolicy registers bf16 parameters (PyTorch's example checks it)
    bf16 = sharded_net(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    bf16.to_empty(device=dev) if bf16.head.weight.is_meta else None
    bf16.unshard()
    res["unshard_dtype_bf16"] = str(bf16.head.weight.dtype)
    bf16.reshard()
    res["reshard_dtype"] = str(bf16.head.weight.dtype)
    res["reshard_registers_shards"] = isinstance(net.head.weight, fsdp.ShardedParameter)

    # unshard() then a forward under autograd: gradients reach the shards as without it
    handle = net.unshard(async_op=True)
    handle.wait()
    _grads_of(net, tokens.to(dev), targets.to(dev))
    _grads_of(ref, tokens, targets)
    torch_xla.sync()
    res["unshard_then_backward_grad_diff"] = max(
        float((a.grad.cpu()[: b.shape[0]].reshape(b.shape) - b.grad).abs().max())
        for a, b in zip(net.parameters(), ref.parameters()))

    # set_gradient_divide_factor(f): gradients times (processes / f)
    net.zero_grad()
    net.set_gradient_divide_factor(0.5)
    _grads_of(net, tokens.to(dev), targets.to(dev))
    torch_xla.sync()
    res["divide_factor_ratio"] = float(net.head.weight.grad.cpu()[:10].norm() / ref.head.weight.grad.norm())
    net.set_gradient_divide_factor(float(fsdp.device_mesh.process_count()))

    # set_requires_gradient_sync(False) on two micro-batches, then True: the sum of both gradients
    net.zero_grad()
    ref.zero_grad()
    net.set_requires_gradient_sync(False)
    _grads_of(net, tokens[:8].to(dev), targets[:8].to(dev))
    net.set_requires_gradient_sync(True)
    _grads_of(net, tokens.flip(0).to(dev), targets.flip(0).to(dev))
    _grads_of(ref, tokens[:8], targets[:8])
    _grads_of(ref, tokens.flip(0), targets.flip(0))
    torch_xla.sync()
    res["accumulation_grad_diff"] = max(
        float((a.grad.cpu()[: b.shape[0]].reshape(b.shape) - b.grad).abs().max())
        for a, b in zip(net.parameters(), ref.parameters()))

    # explicit prefetch: block 0's forward starts block 2's gather (not block 1's)
    net.zero_grad()
    net.blocks[0].set_modules_to_forward_prefetch([net.blocks[2]])
    seen = {}
    hook = net.blocks[1].register_forward_pre_hook(
        lambda m, a: seen.update(b2=state_of(net.blocks[2])._prefetched is not None))
    _grads_of(net, tokens.to(dev), targets.to(dev))
    hook.remove()
    res["explicit_prefetch_started"] = bool(seen.get("b2"))
    # meta-device init: to_empty gives every parameter sharded device storage (each device its rows),
    # and each module's own reset_parameters() fills it (nn.Linear: uniform within 1/sqrt(fan_in))
    with torch.device("meta"):
        meta = Net()
    for b in meta.blocks:
        fully_shard(b)
    fully_shard(meta)
    meta.to_empty(device=dev)
    for m in meta.modules():
        if hasattr(m, "reset_parameters") and not isinstance(m, FSDPModule):
            m.reset_parameters()
    torch_xla.sync()
    specs = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in meta.named_parameters()}
    w = meta.blocks[1].a.weight.full_tensor().detach().cpu()
    res["meta_init"] = {"all_sharded": all(s.startswith("{devices=[4") for s in specs.values()),
                        "classes": sorted({type(p).__name__ for p in meta.parameters()}),
                        "within_bound": bool(w.abs().max() <= 8 ** -0.5 + 1e-6), "spread": float(w.std()),
                        "embedding_std": float(meta.emb.weight.full_tensor().detach().cpu().std())}
    for name in ("set_custom_all_gather", "set_unshard_in_backward"):
        res[f"refused_{name}"] = _error(lambda: getattr(net, name)(None))
    res["noop_methods"] = _error(lambda: (net.set_is_last_backward(True), net.set_reshard_after_backward(False),
                                          net.set_post_optim_event(None), net.set_requires_all_reduce(True)))
    _write(out, res)


def ignored(out):
    """FSDP2's ignored_params: a Net whose embedding is left out of its unit, against the same Net
    unsharded: loss and every gradient after one step, and where the ignored parameter lives."""
    dev = torch_xla.device()
    tokens, targets, ref, state = _reference()
    net = Net()
    net.load_state_dict(state)
    for b in net.blocks:
        fully_shard(b)
    fully_shard(net, ignored_params={net.emb.weight})
    net.to(dev)
    want_loss = _grads_of(ref, tokens, targets)
    got_loss = _grads_of(net, tokens.to(dev), targets.to(dev))
    grads = {n: p.grad for n, p in net.named_parameters()}
    diffs = {n: float((grads[n].detach().cpu()[: p.shape[0]].reshape(p.shape) - p.grad).abs().max())
             for n, p in ref.named_parameters()}
    _write(out, {"loss_diff": abs(got_loss.item() - want_loss.item()), "max_grad_diff": max(diffs.values()),
                 "emb_class": type(net.emb.weight).__name__, "emb_sharding": torch_xla._XLAC._get_xla_sharding_spec(
                     net.emb.weight), "emb_in_state_dict": "emb.weight" in net.state_dict(),
                 "stray": _error(lambda: fully_shard(Block(), ignored_params={net.emb.weight}))})


def grouped(out):
    """fully_shard([net.emb, net.head]): one unit of two modules (one group), inside a root; 3 AdamW
    steps against the unsharded Net: losses, and every parameter after the steps; the state dicts'
    keys; overlapping lists refused."""
    dev = torch_xla.device()
    torch.manual_seed(0)
    ref = Net()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    net = Net()
    net.load_state_dict(state)
    for b in net.blocks:
        fully_shard(b)
    fully_shard([net.emb, net.head])
    fully_shard(net)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, net)]
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        tokens, targets = torch.randint(0, 10, (8, 4), generator=gen), torch.randint(0, 10, (8, 4), generator=gen)
        pair = []
        for model, opt, where in ((ref, opts[0], "cpu"), (net, opts[1], dev)):
            loss = _grads_of(model, tokens.to(where), targets.to(where))
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    got = net.state_dict()
    from xla_fsdp.unit_state import units

    bad = Net()
    _write(out, {"losses": losses, "max_param_diff": max(float((got[k].cpu() - v).abs().max())
                                                       for k, v in ref.state_dict().items()),
                 "keys_equal": sorted(got) == sorted(state),
                 "one_state": state_of(net.emb) is state_of(net.head), "group_params": len(state_of(net.emb).group.params),
                 "both_fsdp": isinstance(net.emb, FSDPModule) and isinstance(net.head, FSDPModule),
                 "units": len(units(net)),
                 "overlap": _error(lambda: fully_shard([bad.blocks[0], bad.blocks[0].a])),
                 "twice": _error(lambda: fully_shard([bad.head, bad.head])),
                 "overlap_untouched": type(bad.blocks[0]) is Block})


def doors(out):
    """What each front door makes of a module: isinstance, units, where the policies live."""
    from xla_fsdp import XlaFullyShardedDataParallel, always_wrap_policy
    from xla_fsdp.unit_state import units

    def kinds(net):
        state = state_of(net)
        return {"FSDPModule": isinstance(net, FSDPModule),
                "XlaFullyShardedDataParallel": isinstance(net, XlaFullyShardedDataParallel),
                "Net": isinstance(net, Net), "units": len(units(net)),
                "state_holds_policies": state.mp_policy is not None and state.device_mesh is not None
                and type(state.device_mesh).__name__ == "DeviceMesh"}

    torch.manual_seed(0)
    v1 = Net()
    for i, b in enumerate(v1.blocks):
        v1.blocks[i] = XlaFullyShardedDataParallel(b)
    v1 = XlaFullyShardedDataParallel(v1)
    mixed = Net()
    mixed.blocks[0] = XlaFullyShardedDataParallel(mixed.blocks[0], auto_wrap_policy=always_wrap_policy)
    _write(out, {"fully_shard": kinds(sharded_net()), "v1": kinds(v1), "mixed": _error(lambda: fully_shard(mixed))})


def tied(out):
    """A Hugging Face GPT-2 moved to the device before fully_shard (torch_xla's .to() unties its
    embeddings, [Note: ties lost on the way to the device]): re-tied with a warning; 3 AdamW steps
    against the tied model unsharded on the CPU."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    dev = torch_xla.device()
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(config)
    net = GPT2LMHeadModel(config)
    net.load_state_dict(ref.state_dict())
    net.to(dev)
    untied = net.transformer.wte.weight is not net.lm_head.weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in net.transformer.h:
            fully_shard(block)
        fully_shard(net)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, net)]
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 64, (8, 8), generator=gen)
        pair = []
        for model, opt, where in ((ref, opts[0], "cpu"), (net, opts[1], dev)):
            loss = model(input_ids=tokens.to(where), labels=tokens.to(where)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    got = net.state_dict()
    # torch_xla's FSDPv2 name (the GSPMD engine) re-ties the same way
    import numpy as np
    import torch_xla.distributed.spmd as xs

    from xla_fsdp import SpmdFullyShardedDataParallel

    v2 = GPT2LMHeadModel(config).to(dev)
    with warnings.catch_warnings(record=True) as caught_v2:
        warnings.simplefilter("always")
        n = xr.global_runtime_device_count()
        SpmdFullyShardedDataParallel(v2, xs.Mesh(np.arange(n), (n,), ("fsdp",)))
    _write(out, {"v2_tied_after": v2.transformer.wte.weight is v2.lm_head.weight,
                 "v2_warnings": [str(w.message) for w in caught_v2],
                 "untied_by_to": untied, "tied_after": net.transformer.wte.weight is net.lm_head.weight,
                 "warnings": [str(w.message) for w in caught], "losses": losses,
                 "max_param_diff": max(float((got[k].cpu() - v).abs().max()) for k, v in ref.state_dict().items())})


def _loop(steps, sync_each_step):
    """Train a fresh sharded net `steps` steps as a GPU loop would (forward, backward, clipping,
    AdamW, zero_grad, the loss read), optionally with torch_xla.sync() after each step; per step:
    XLA compiles so far, graph cuts so far, executions so far."""
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    net = sharded_net(seed=3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(steps):
        tokens = torch.randint(0, 10, (8, 6), generator=gen).to(dev)
        loss = _grads_of(net, tokens, tokens.roll(1, 1))
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if sync_each_step:
            torch_xla.sync()
        loss.item()
        rows.append({"compiles": met.metric_data("CompileTime")[0], "cuts": met.counter_value("MarkStep") or 0,
                     "executions": met.counter_value("ExecuteReplicated") or met.counter_value("ExecuteComputation") or 0})
    return rows


def cuts(out):
    sync = _loop(6, True)  # first: its first step is the process's first ([Note: the step cut])
    _write(out, {"sync": sync, "nosync": _loop(12, False)})


if __name__ == "__main__":
    # the SPMD runtime, then the XLA runtime, before any autograd runs: torch's autograd engine sizes
    # its per-device queues when it first runs, so a CPU backward first would leave none for XLA
    xr.use_spmd()
    torch_xla.device()
    xr.global_runtime_device_count()
    {"errors": errors, "methods": methods, "cuts": cuts, "doors": doors, "ignored": ignored,
     "grouped": grouped, "tied": tied}[sys.argv[1]](sys.argv[2])
