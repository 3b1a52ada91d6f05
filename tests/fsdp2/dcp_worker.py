"""DCP and state-dict scenarios of `xla_fsdp.fsdp` models, one XLA runtime per process.

SPMD mode and the device count are fixed when the runtime starts, so
tests/test_fsdp2_dcp.py runs this file in a fresh process with CPU_NUM_DEVICES
set. Results go to a torch file:

  dcp_worker.py save OUT ROOT [URL ...]   (4 devices) train a small Llama 1 step; every
        get_state_dict / set_state_dict option into a second model; the full-state-dict
        torch.save + distribute_tensor + load_state_dict(assign=True) pattern; dcp.save to
        ROOT/ckpt and to each URL and dcp.load back; a checkpoint of other shapes
  dcp_worker.py load OUT ROOT          (any device count) dcp.load ROOT/ckpt into a fresh model
        and optimizer, then one step; at 1 device also into an unwrapped CPU model and
        through dcp_to_torch_save

Everything compared is recorded as a max abs difference (the test holds the bounds);
`specs` lists any parameter or optimizer state tensor not sharded like its parameter.
"""
from __future__ import annotations

import copy
import os
import sys

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT_DIR)
sys.path.insert(0, os.path.join(ROOT_DIR, "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402

import xla_fsdp.fsdp as fsdp2  # noqa: E402
from xla_fsdp.fsdp import dcp as dcp_storage  # noqa: E402

import fsdp2_llama as ex  # noqa: E402

CONFIG = ex.LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=67, ffn_dim=48, max_seq_len=16)
OTHER_VOCAB = 71  # a checkpoint of other shapes


def start():
    dist.init_process_group("gloo", init_method="xla://")  # enters the single controller (SPMD) first
    import torch_xla

    return torch_xla


def build(seed: int, cfg=CONFIG, init: bool = True):
    import torch_xla

    with torch.device("meta"):
        model = ex.Llama(cfg)
    for layer in model.layers:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    model.to_empty(device=torch_xla.device())
    if init:
        torch.manual_seed(seed)
        model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch_xla.sync()
    return model, optimizer


def batch(step: int, cfg=CONFIG):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len + 1), generator=g)


def train_step(model, optimizer, step: int) -> float:
    import torch_xla

    tokens = batch(step).to(torch_xla.device())
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()
    return loss.item()


def full_state(model, optimizer):
    """Model and optimizer state as full CPU tensors (keys by name), copied: the optimizer's
    `step` counters come back as the live CPU tensors the next step increments."""
    return copy.deepcopy(get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def max_diff(a, b) -> float:
    """Largest abs difference over two nested state dicts (inf if their keys or shapes differ)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return float("inf")
        return max([max_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max([max_diff(x, y) for x, y in zip(a, b)] or [0.0])
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return float("inf")
        return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item() if a.numel() else 0.0
    return 0.0 if a == b else float("inf")


def spec_faults(model, optimizer):
    """Parameters not sharded on dim 0, and optimizer state tensors shaped like their
    parameter but sharded otherwise."""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec
    faults = []
    for name, p in model.named_parameters():
        ps = spec(p)
        if not ps.startswith("{devices=[") and torch_xla.runtime.global_runtime_device_count() > 1:
            faults.append(f"{name}: {ps!r}")
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == tuple(p.shape):
                if v.device.type != "xla" or spec(v) != ps:
                    faults.append(f"{name}.{key}: {spec(v) if v.device.type == 'xla' else v.device} vs {ps!r}")
    return faults


def unwrapped_shapes():
    with torch.device("meta"):
        plain = ex.Llama(CONFIG)
    return {k: tuple(v.shape) for k, v in plain.state_dict().items()}


def scramble(model, optimizer):
    """Overwrite parameters (in place) and optimizer state, so a load must set them. State
    tensors are replaced, not filled: torch's Optimizer.load_state_dict keeps a loaded tensor
    that is already on the parameter's device, so after a load from a live optimizer's
    state dict both optimizers hold the same tensors."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device.type == "xla":
                    state[k] = v * 0 + 0.25


def save(out: str, root: str, urls):
    import time

    t0 = time.perf_counter()
    torch_xla = start()
    model, optimizer = build(seed=1)
    losses = [train_step(model, optimizer, 0)]  # AdamW's state exists from here on
    ref_model, ref_optim = full_state(model, optimizer)
    expected = unwrapped_shapes()
    result = {"losses": losses, "ref": (ref_model, ref_optim), "api": {}, "specs": {}}
    result["shapes"] = {
        "model": {k: (tuple(v.shape), expected[k]) for k, v in ref_model.items()},
        "optim": {f"{k}.{n}": (tuple(v.shape), expected[k]) for k, st in ref_optim["state"].items()
                  for n, v in st.items() if v.dim()},
    }
    result.setdefault("seconds", {})["train"] = time.perf_counter() - t0
    other, other_optim = build(seed=2)
    train_step(other, other_optim, 0)  # optimizer state exists, then it is overwritten
    for name, opts in {
        "sharded": StateDictOptions(),
        "sharded_cpu": StateDictOptions(cpu_offload=True),
        "full": StateDictOptions(full_state_dict=True),
        "full_cpu": StateDictOptions(full_state_dict=True, cpu_offload=True),
        "full_bcast": StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True),
    }.items():
        msd, osd = get_state_dict(model, optimizer, options=opts)
        value = msd["output.weight"]
        scramble(other, other_optim)
        set_state_dict(other, other_optim, model_state_dict=msd, optim_state_dict=osd, options=opts)
        got_model, got_optim = full_state(other, other_optim)
        result["api"][name] = {"model": max_diff(ref_model, got_model), "optim": max_diff(ref_optim, got_optim),
                               "device": value.device.type, "shape": tuple(value.shape)}
        result["specs"][name] = spec_faults(other, other_optim)
    result.setdefault("seconds", {})["api"] = time.perf_counter() - t0
    # FSDP2's full-state-dict pattern: save full CPU tensors, load onto a meta model with assign=True
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    torch.save(full, os.path.join(root, "full.pt"))
    from torch.distributed.tensor import distribute_tensor

    loaded = torch.load(os.path.join(root, "full.pt"), weights_only=True)
    with torch.device("meta"):
        meta = ex.Llama(CONFIG)
    for layer in meta.layers:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(meta)
    meta_sd = meta.state_dict()
    meta.load_state_dict({k: distribute_tensor(loaded[k], meta_sd[k].device_mesh, meta_sd[k].placements)
                          for k in loaded}, assign=True)
    meta.to_empty(device=torch_xla.device())
    result["full_pattern"] = {"types": sorted({type(v).__name__ for v in model.state_dict().values()}),
                              "diff": max_diff(full, {k: v.full_tensor().cpu() for k, v in meta.state_dict().items()}),
                              "specs": spec_faults(meta, torch.optim.AdamW(meta.parameters()))}

    result.setdefault("seconds", {})["full_pattern"] = time.perf_counter() - t0
    # DCP: the state after step 3, to a directory and to each URL, and back
    state = _dcp_state(model, optimizer, step=3)
    targets = [os.path.join(root, "ckpt")] + list(urls)
    result["dcp"] = {}
    for target in targets:
        dcp.save(state, storage_writer=dcp_storage.storage_writer(target))
        scramble(other, other_optim)
        into = _dcp_state(other, other_optim, step=0)
        dcp.load(into, storage_reader=dcp_storage.storage_reader(target))
        set_state_dict(other, other_optim, model_state_dict=into["model"], optim_state_dict=into["optim"])
        result["dcp"][target] = {"diff": max_diff(full_state(model, optimizer), full_state(other, other_optim)),
                                 "step": into["step"], "complete": dcp_storage.is_complete(target),
                                 "specs": spec_faults(other, other_optim)}
    # the same checkpoint through dcp.save's own choice of writer (checkpoint_id=path)
    dcp.save(state, checkpoint_id=os.path.join(root, "ckpt_plain"))
    result["ref_after"] = full_state(model, optimizer)
    result["next_loss_after"] = train_step(model, optimizer, 3)

    result.setdefault("seconds", {})["dcp"] = time.perf_counter() - t0
    # a checkpoint whose shapes are not the model's
    wrong_cfg = ex.LlamaConfig(**{**CONFIG.__dict__, "vocab_size": OTHER_VOCAB})
    wrong, wrong_optim = build(seed=3, cfg=wrong_cfg, init=False)  # DCP plans (and fails) before reading
    try:
        dcp.load(_dcp_state(wrong, wrong_optim, step=0), storage_reader=dcp_storage.storage_reader(targets[0]))
        result["mismatch"] = None
    except BaseException as e:  # DCP wraps the planner's error in a CheckpointException (a BaseException)
        result["mismatch"] = f"{type(e).__name__}: {e}"
    result["seconds"]["mismatch"] = time.perf_counter() - t0
    result["compiles"] = _compiles()
    torch.save(result, out)


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _dcp_state(model, optimizer, step: int):
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "step": step}


def load(out: str, root: str):
    import torch_xla

    start()
    ref = torch.load(os.path.join(root, "save.pt"), weights_only=False)
    model, optimizer = build(seed=5)
    train_step(model, optimizer, 0)  # state exists; the load overwrites it
    state = _dcp_state(model, optimizer, step=0)
    dcp.load(state, storage_reader=dcp_storage.storage_reader(os.path.join(root, "ckpt")))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    devices = torch_xla.runtime.global_runtime_device_count()
    result = {"devices": devices, "step": state["step"], "diff": max_diff(ref["ref_after"], full_state(model, optimizer)),
              "specs": spec_faults(model, optimizer)}
    result["next_loss"] = train_step(model, optimizer, 3)
    if devices == 1:
        # an unwrapped model on the CPU, through dcp.load and through dcp_to_torch_save
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        plain = ex.Llama(CONFIG)
        plain_sd = plain.state_dict()
        dcp.load({"model": plain_sd}, checkpoint_id=os.path.join(root, "ckpt_plain"))
        plain.load_state_dict(plain_sd)
        result["plain_diff"] = max_diff(ref["ref_after"][0], dict(plain.state_dict()))
        dcp_to_torch_save(os.path.join(root, "ckpt"), os.path.join(root, "converted.pt"))
        converted = torch.load(os.path.join(root, "converted.pt"), weights_only=False)
        result["converted_diff"] = max_diff(ref["ref_after"][0], converted["model"])
        result["converted_optim_diff"] = max(
            max_diff(ref["ref_after"][1]["state"][k], converted["optim"]["state"][k]) for k in ref["ref_after"][1]["state"])
    result["compiles"] = _compiles()
    torch.save(result, out)


if __name__ == "__main__":
    mode, out, root, *rest = sys.argv[1:]
    if mode == "save":
        save(out, root, rest)
    elif mode == "load":
        load(out, root)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
