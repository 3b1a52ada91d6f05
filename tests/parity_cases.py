"""Shared models, data and training loops for the parity tests.

A case trains the same model twice from the same seed: sharded (each rank on
its own micro-batch) and unsharded on the global batch. Results are plain
tensors so the parent process can compare them.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn as nn

# the models and the gloo runner are bench/common's, shared with bench/ (tests/conftest.py puts
# bench/ on the path; a worker that imports this file alone gets it here)
_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if _BENCH not in sys.path:
    sys.path.append(_BENCH)
from common.gloo import exit_without_finalizers as _exit_without_finalizers, run_distributed_fn  # noqa: E402,F401
from common.models import GLOBAL_BATCH, batch, build_model, gpt2_config, loss_fn  # noqa: E402,F401

STEPS = 5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # "mlp" | "mlp_nested" | "mlp_mixed" | "mlp_tiles" | "gpt2"
    optim: str = "adamw"  # "sgd" | "adamw"
    fsdp: tuple = ()  # engine keyword arguments as (key, value) pairs
    clip: Optional[float] = None
    checkpoint: bool = False
    worlds: tuple = (2, 4)
    # other libraries' per-module wrappers (see wrap()): "txla_ckpt", "txla_ckpt_after",
    # "txla_linear", "txla_linear_after", "torch_ckpt_wrapper"
    foreign: str = ""
    # keyword arguments the inner units have instead of fsdp's: mlp_nested's inner unit, or
    # gpt2's auto-wrapped blocks (through an auto_wrapper_callable)
    inner: tuple = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.fsdp)


# The parity matrix: every variant of the engine against the unsharded reference.
# Shared by the gloo runtime (tests/test_parity_dist.py) and the single-controller
# runtime (tests/test_single_controller.py).
MATRIX = [
    Case("mlp_sgd", "mlp", "sgd"),
    Case("mlp_adamw", "mlp", "adamw"),
    Case("mlp_nested_adamw", "mlp_nested", "adamw"),
    Case("gpt2_sgd", "gpt2", "sgd"),
    Case("gpt2_adamw", "gpt2", "adamw"),
    Case("gpt2_no_reshard", "gpt2", "adamw", fsdp=(("reshard_after_forward", False),)),
    Case("gpt2_reshard_root", "gpt2", "adamw", fsdp=(("disable_reshard_on_root", False),)),
    Case("mlp_shard_grad_op", "mlp_nested", "adamw", fsdp=(("sharding_strategy", "SHARD_GRAD_OP"),)),
    Case("gpt2_no_shard", "gpt2", "adamw", fsdp=(("sharding_strategy", "NO_SHARD"),)),
    Case("gpt2_clip", "gpt2", "adamw", clip=0.05),
    Case("mlp_clip_sgd", "mlp_nested", "sgd", clip=0.1),
    Case("mlp_unflat_buckets", "mlp_nested", "adamw", fsdp=(("flatten_parameters", False),)),
    Case("mlp_mixed_sizes", "mlp_mixed", "adamw"),  # default buckets: small ones together, large alone
    Case("mlp_tiles", "mlp_tiles", "adamw", worlds=()),  # 8 devices, rings: [Note: ring gathers in the shard's shape]
    Case("gpt2_flat", "gpt2", "sgd", fsdp=(("flatten_parameters", True),)),
    Case("gpt2_txla_ckpt", "gpt2", "adamw", foreign="txla_ckpt"),
    Case("gpt2_torch_ckpt_wrapper", "gpt2", "adamw", foreign="torch_ckpt_wrapper"),
    Case("mlp_txla_linear", "mlp", "adamw", foreign="txla_linear"),
    Case("mlp_txla_linear_after", "mlp", "adamw", foreign="txla_linear_after"),
    # torch_xla's checkpoint only runs on XLA tensors: the single-controller runtime and XLA world 1
    Case("gpt2_txla_ckpt_after", "gpt2", "adamw", foreign="txla_ckpt_after", worlds=()),
    Case("gpt2_no_prefetch", "gpt2", "adamw", worlds=(), fsdp=(("forward_prefetch", False),
                                                              ("backward_prefetch", None))),
    Case("gpt2_rs_buckets", "gpt2", "adamw", fsdp=(("reduce_scatter_bucket_size_mb", 0.01),)),
    Case("gpt2_checkpoint", "gpt2", "adamw", checkpoint=True),
    # configs/fsdp/gpt2_2b_v4_kernel.json's engine settings: per-layer checkpointing, no prefetch
    # (the shipped gpt2_xla_fsdp.json is gpt2_checkpoint: checkpointing, prefetch on)
    # scan_layers on the collectives engine: the blocks as one XLA loop (single controller only)
    Case("gpt2_ckpt_scan", "gpt2", "adamw", checkpoint=True, worlds=(), fsdp=(("scan_layers", True),)),
    Case("gpt2_ckpt_scan_bf16", "gpt2", "adamw", checkpoint=True, worlds=(), clip=0.05,
         fsdp=(("scan_layers", True), ("compute_dtype", torch.bfloat16))),
    # buckets large enough to reduce-scatter one torus axis at a time on 2x2x2 (8 rows of 128 a device)
    Case("gpt2_small_sgd", "gpt2_small", "sgd", worlds=()),
    Case("gpt2_ckpt_bf16", "gpt2", "adamw", checkpoint=True, worlds=(), clip=0.05,
         fsdp=(("compute_dtype", torch.bfloat16),)),  # gpt2_ckpt_scan_bf16 unscanned
    Case("gpt2_ckpt_no_prefetch", "gpt2", "adamw", checkpoint=True, worlds=(), fsdp=(("forward_prefetch", False),
                                                                          ("backward_prefetch", None))),
    Case("mlp_bf16", "mlp_nested", "sgd", fsdp=(("compute_dtype", torch.bfloat16),)),
    Case("gpt2_bf16_fp32rs", "gpt2", "sgd", fsdp=(("compute_dtype", torch.bfloat16),
                                                  ("fp32_reduce_scatter", True))),
    Case("gpt2_hybrid", "gpt2", "adamw", worlds=(4,),
         fsdp=(("sharding_strategy", "HYBRID_SHARD"), ("sharding_groups", [[0, 1], [2, 3]]))),
    # stored stacks sharded within each half, replicated across the halves
    Case("gpt2_ckpt_scan_hybrid", "gpt2", "adamw", checkpoint=True, worlds=(),
         fsdp=(("scan_layers", True), ("sharding_strategy", "HYBRID_SHARD"))),
]

# Nested units that shard differently from their root ([Note: units with different layouts] in
# xla_fsdp/collective_engine/clip_grad.py), clipping active. Parameters are rebuilt per unit.
MIXED_LAYOUTS = [
    Case("mlp_no_shard_inside_full_shard", "mlp_nested", "adamw", clip=0.1, worlds=(2,),
         inner=(("sharding_strategy", "NO_SHARD"),)),
    Case("mlp_full_shard_inside_no_shard", "mlp_nested", "sgd", clip=0.1, worlds=(2,),
         fsdp=(("sharding_strategy", "NO_SHARD"),), inner=(("sharding_strategy", "FULL_SHARD"),)),
    # auto-wrapped blocks given FULL_SHARD by an auto_wrapper_callable under a NO_SHARD root
    # (the embeddings replicated): [Note: collectives passed down]
    Case("gpt2_full_shard_blocks_no_shard_root", "gpt2", "adamw", clip=0.05, worlds=(2,),
         fsdp=(("sharding_strategy", "NO_SHARD"),), inner=(("sharding_strategy", "FULL_SHARD"),)),
]


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # eps: GPT-2's key bias has a mathematically zero gradient (softmax ignores a shift
    # shared by all keys), so its computed gradient is fp32 rounding noise whose pattern
    # depends on summation order; with the default eps Adam turns that noise into
    # lr-sized steps in *both* runs, and no two implementations could agree on them
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-4)


def wrap(case: Case, model: nn.Module, extra: Optional[dict] = None) -> nn.Module:
    import xla_fsdp
    from xla_fsdp import FSDP

    kwargs = {**case.kwargs, **(extra or {})}
    if case.foreign:
        return _wrap_foreign(case, model, kwargs)
    if case.model == "gpt2":
        kwargs.setdefault("auto_wrap_policy", xla_fsdp.wrap.transformer_policy(["GPT2Block"]))
        if case.checkpoint:
            kwargs["auto_wrapper_callable"] = lambda m, **kw: FSDP(xla_fsdp.checkpoint_module(m), **kw)
        elif case.inner:
            kwargs["auto_wrapper_callable"] = lambda m, **kw: FSDP(m, **{**kw, **dict(case.inner)})
    if case.model == "mlp_nested":
        model[2] = FSDP(model[2], **{**kwargs, **dict(case.inner)})
        if case.checkpoint:
            xla_fsdp.checkpoint_module(model[2])
    return FSDP(model, **kwargs)


def _wrap_foreign(case: Case, model: nn.Module, kwargs: dict) -> nn.Module:
    """Units made the way torch_xla / Hugging Face / torch users make them."""
    import xla_fsdp
    from xla_fsdp import FSDP

    if case.foreign in ("txla_ckpt", "txla_ckpt_after", "torch_ckpt_wrapper"):
        from torch_xla.distributed.fsdp import checkpoint_module as txla_checkpoint

        if case.foreign == "txla_ckpt":  # Hugging Face Trainer's xla_fsdp_grad_ckpt: FSDP(checkpoint_module(layer))
            wrapper = lambda m, **kw: FSDP(txla_checkpoint(m), **kw)  # noqa: E731
        elif case.foreign == "txla_ckpt_after":
            wrapper = lambda m, **kw: txla_checkpoint(FSDP(m, **kw))  # noqa: E731
        else:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            wrapper = lambda m, **kw: FSDP(checkpoint_wrapper(m), **kw)  # noqa: E731
        return FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                    auto_wrapper_callable=wrapper, **kwargs)
    from torch_xla.distributed.fsdp.utils import apply_xla_patch_to_nn_linear

    if case.foreign == "txla_linear":  # every Linear patched, then each its own unit
        return FSDP(apply_xla_patch_to_nn_linear(model), auto_wrap_policy=xla_fsdp.always_wrap_policy, **kwargs)
    return apply_xla_patch_to_nn_linear(FSDP(model, auto_wrap_policy=xla_fsdp.always_wrap_policy, **kwargs))


def train_reference(case: Case, steps: int = STEPS, rows: slice = slice(None), size: int = GLOBAL_BATCH) -> Dict:
    """The unsharded model trained on the global batch of `size` (or on `rows` of it)."""
    model = build_model(case.model)
    opt = make_optimizer(case.optim, model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(case.model, step, size)
        x, y = x[rows], y[rows]
        loss = loss_fn(case.model, model, x, y)
        loss.backward()
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train_sharded(case: Case, rank: int, world: int, device=None, sync=None) -> Dict:
    """Train on this rank's micro-batch; returns mean loss per step and this rank's shards."""
    model = build_model(case.model)
    model = wrap(case, model)
    opt = make_optimizer(case.optim, model.parameters())
    per = GLOBAL_BATCH // world
    losses: List[torch.Tensor] = []
    for step in range(STEPS):
        x, y = batch(case.model, step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = loss_fn(case.model, model, x, y)
        loss.backward()
        if case.clip is not None:
            model.clip_grad_norm_(case.clip)
        opt.step()
        opt.zero_grad()
        if sync is not None:
            sync()
        losses.append(loss.detach())
    return {"losses": [float(l.cpu()) for l in losses],
            "shards": {_plain_name(n): p.detach().cpu().clone() for n, p in model.named_parameters()},
            "groups": [list(g) for g in model.sharding_layout.shard_groups],
            "unit_groups": _unit_groups(model)}


def _unit_groups(model: nn.Module) -> Dict[str, List[List[int]]]:
    """Each parameter's sharding groups: those of the unit that owns it (nested units may differ)."""
    owner = {}
    for m in model.modules():
        unit = getattr(m, "_fsdp_state", None)
        if unit is not None:
            for fp in unit.group.params:
                owner[id(fp.sharded)] = [list(g) for g in unit.group.comm.layout.shard_groups]
    return {_plain_name(n): owner[id(p)] for n, p in model.named_parameters()}


def train_single_controller(case: Case, steps: int = STEPS) -> Dict:
    """The single-controller runtime (torch_xla's SPMD runtime must be on): one process
    feeds the global batch; returns the per-step global losses and the full parameters
    cut from the global (dim-0 padded) tensors."""
    import torch_xla

    device = torch_xla.device()
    model = wrap(case, build_model(case.model))
    opt = make_optimizer(case.optim, model.parameters())
    losses: List[torch.Tensor] = []
    for step in range(steps):
        x, y = batch(case.model, step)
        loss = loss_fn(case.model, model, x.to(device), y.to(device))
        loss.backward()
        if case.clip is not None:
            model.clip_grad_norm_(case.clip)
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        losses.append(loss.detach())
    from xla_fsdp.runtime.stored_keys import stack_table

    stacks = stack_table(model)  # scan_layers' stored stacks: each layer's column, by its unscanned name
    padded = {}
    for n, p in model.named_parameters():
        for i, layer_name in enumerate(stacks.get(n, [])):
            padded[_plain_name(layer_name)] = p.detach().cpu().select(1, i)
        if n not in stacks:
            padded[_plain_name(n)] = p.detach().cpu()
    return {"losses": [float(l.cpu()) for l in losses], "padded": padded, "stacked": sorted(stacks),
            "groups": [list(g) for g in model.sharding_layout.shard_groups]}


def unpad(padded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A global dim-0 padded parameter -> the unwrapped parameter's shape."""
    rows = like.shape[0] if like.dim() else 1
    return padded.reshape(-1, *like.shape[1:])[:rows].reshape(like.shape)


def _plain_name(name: str) -> str:
    # torch's checkpoint_wrapper registers the module it wraps under this name (its state_dict drops it)
    return name.replace("_checkpoint_wrapped_module.", "")


def assemble(ref_params: Dict[str, torch.Tensor], shards_by_rank: List[Dict[str, torch.Tensor]],
             group: List[int]) -> Dict[str, torch.Tensor]:
    """Rebuild full parameters from the shards of one sharding group (independently of the engine)."""
    out = {}
    for name, ref in ref_params.items():
        rows = ref.shape[0] if ref.dim() else 1
        parts = [shards_by_rank[r][name] for r in group]
        full = torch.cat(parts)[:rows]
        out[name] = full.reshape(ref.shape)
    return out


# -- multi-process (torch.distributed, gloo) -----------------------------------

def _dist_worker(rank: int, world: int, store_path: str, cases: List[Case], out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.pop("PJRT_DEVICE", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        results = {}
        for case in cases:
            res = train_sharded(case, rank, world)
            mean = torch.tensor(res["losses"])
            dist.all_reduce(mean)
            res["losses"] = (mean / world).tolist()
            results[case.name] = res
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    _exit_without_finalizers()


def run_distributed(cases: List[Case], world: int, tmp_dir: str) -> List[Dict]:
    """Run `cases` on `world` gloo processes; returns each rank's results."""
    import torch.multiprocessing as mp

    store = os.path.join(tmp_dir, f"store{world}")
    mp.start_processes(_dist_worker, args=(world, store, cases, tmp_dir), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(os.path.join(tmp_dir, f"rank{r}.pt")) for r in range(world)]


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """Tensor-relative error ||got - want|| / ||want|| <= rel.

    Elementwise relative checks are meaningless on the few near-zero entries
    where Adam divides summation-order noise by a near-zero second moment; the
    norm-relative error bounds the whole tensor at the stated tolerance.
    """
    got, want = got.double(), want.double()
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g} (max abs diff {(got - want).abs().max():.3g})"


def train_accumulated(case: Case, rank: int, world: int, mode: str, micro: int = 2, device=None, sync=None,
                      global_batch: bool = False, size: int = GLOBAL_BATCH) -> Dict:
    """STEPS optimizer steps, each over `micro` micro-batches of this rank's slice (the whole
    batch when `global_batch`: the single-controller runtime), gradients accumulated with
    `mode`: "no_sync" (torch_xla/Accelerate), "requires_sync" (FSDP2's
    set_requires_gradient_sync) or "shards" (reduce-scatter every micro-batch)."""
    import contextlib

    model = wrap(case, build_model(case.model))
    opt = make_optimizer(case.optim, model.parameters())
    per = size if global_batch else size // world
    start = 0 if global_batch else rank * per
    losses = []
    for step in range(STEPS):
        x, y = batch(case.model, step, size)
        x, y = x[start:start + per], y[start:start + per]
        each = per // micro
        total = 0.0
        for m in range(micro):
            last = m == micro - 1
            xm_, ym_ = x[m * each:(m + 1) * each], y[m * each:(m + 1) * each]
            if device is not None:
                xm_, ym_ = xm_.to(device), ym_.to(device)
            ctx = contextlib.nullcontext()
            if mode == "no_sync" and not last:
                ctx = model.no_sync()
            if mode == "requires_sync":
                model.set_requires_gradient_sync(last)
            with ctx:
                loss = loss_fn(case.model, model, xm_, ym_) / micro
                loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        if sync is not None:
            sync()
        losses.append(total)
    return {"losses": [float(l.cpu()) for l in losses],
            "shards": {_plain_name(n): p.detach().cpu().clone() for n, p in model.named_parameters()},
            "groups": [list(g) for g in model.sharding_layout.shard_groups]}


def _accumulate_worker(rank: int, world: int, tmp_dir: str, cases: List[Case], modes: List[str]) -> None:
    import torch.distributed as dist

    out = {}
    for case in cases:
        for mode in modes:
            res = train_accumulated(case, rank, world, mode)
            mean = torch.tensor(res["losses"])
            dist.all_reduce(mean)
            res["losses"] = (mean / world).tolist()
            out[(case.name, mode)] = res
    torch.save(out, os.path.join(tmp_dir, f"acc-rank{rank}.pt"))


def run_accumulated(cases: List[Case], modes: List[str], world: int, tmp_dir: str) -> List[Dict]:
    run_distributed_fn(_accumulate_worker, world, tmp_dir, cases, modes)
    return [torch.load(os.path.join(tmp_dir, f"acc-rank{r}.pt"), weights_only=False) for r in range(world)]
