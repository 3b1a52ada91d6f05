"""Pretrain a Llama-style decoder with PyTorch's FSDP2 pattern, on XLA through xla_fsdp.fsdp.

Written as an FSDP2 script for GPUs would be; the lines that differ are marked `# XLA:`
(the imports of fully_shard and its policies, the device, the process group's init).

    python examples/fsdp2_llama.py --steps 20                       # CPU, 1 device
    python launch/xla_spawn.py --num_cores 8 examples/fsdp2_llama.py --steps 20
    python -m xla_fsdp.aot --tpu v5e-8 -- examples/fsdp2_llama.py --preset 1b --batch_size 32

The model (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) is built on the meta
device, sharded per layer and at the root, then given storage and initialized on the chips.
It trains on the embedded corpus (Python's reference docs, as bytes) with AdamW, a cosine
schedule with warmup and gradient clipping; DCP checkpoints every --save_every steps, and
--resume continues from the newest complete one.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torch_xla  # XLA: the device

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xla_fsdp.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: E402  XLA: was torch.distributed.fsdp

XLA_FSDP_TPU_RUNTIME = "single_controller"  # what xla_spawn and the check read: one process drives every chip


# ---------------------------------------------------------------------------- model
@dataclass
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 257
    ffn_dim: int = 176
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


PRESETS = {
    "tiny": LlamaConfig(),
    # a 1B-class Llama (Llama 3.2 1B's shapes, untied head)
    "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                      max_seq_len=2048, rope_theta=500000.0),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None):
    """cos and sin of each position's rotation angle per pair of channels: [seq, head_dim / 2]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def causal_mask(seq_len: int, device=None):
    """True above the diagonal: the positions a token may not attend to."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)


def rotate(x, cos, sin):
    """Rotate channel pairs (even, odd) of x [batch, heads, seq, head_dim] by the position's angles."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    rot_even = even * cos - odd * sin
    rot_odd = even * sin + odd * cos
    return torch.stack((rot_even, rot_odd), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(mask, float("-inf"))
        out = scores.float().softmax(-1).to(q.dtype) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("causal_mask", causal_mask(cfg.max_seq_len), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        mask = self.causal_mask[:s, :s]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.output(self.norm(x))

    @torch.no_grad()
    def reset_parameters(self):
        """Initialize every weight (after to_empty on the chips, or on the host)."""
        cos, sin = rotary_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta,
                                 device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        self.causal_mask.copy_(causal_mask(self.cfg.max_seq_len, self.causal_mask.device))
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)  # residual projections, scaled by depth
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1,
                        layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std)
            for lin in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.trunc_normal_(lin.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=self.cfg.dim ** -0.5)


# ---------------------------------------------------------------------------- data
def token_blocks(seq_len: int) -> torch.Tensor:
    """The embedded corpus as bytes, in blocks of seq_len + 1 tokens (inputs and shifted targets)."""
    from xla_fsdp.train.data import ByteTokenizer, embedded_documents, to_blocks, tokenize_stream

    return to_blocks(tokenize_stream(embedded_documents(), ByteTokenizer()), seq_len + 1)


# ---------------------------------------------------------------------------- checkpoints
def latest_checkpoint(root: str):
    """The newest step-N directory under root whose DCP metadata was written (a complete save)."""
    if not root or not os.path.isdir(root):
        return None
    steps = sorted((int(d.split("-")[1]), d) for d in os.listdir(root)
                   if d.startswith("step-") and os.path.exists(os.path.join(root, d, ".metadata")))
    return (steps[-1][0], os.path.join(root, steps[-1][1])) if steps else None


def save(root: str, step: int, model, optimizer, scheduler):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}
    writer = dcp.FileSystemWriter(os.path.join(root, f"step-{step}"))
    if os.environ.get("FSDP2_LLAMA_HOLD_SAVE") == str(step):  # tests: a job killed in the middle of a save
        writer.finish = _hold_before_metadata(step)
    dcp.save(state, storage_writer=writer)


def _hold_before_metadata(step: int):
    """DCP writes `.metadata` last (in `finish`, after every data file); wait there, forever,
    so a test can SIGKILL the job with the data files written and no metadata."""
    def finish(*args, **kwargs):
        print(f"holding the save of step {step} before its metadata", flush=True)
        while True:
            time.sleep(60)
    return finish


def load(path: str, model, optimizer, scheduler) -> int:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


# ---------------------------------------------------------------------------- training
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=8, help="per process (every chip of the host shares it)")
    p.add_argument("--seq_len", type=int, default=None, help="default: the preset's max_seq_len")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup_steps", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(bfloat16 params, float32 reduce)")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: parameters and optimizer on the host")
    p.add_argument("--activation_checkpointing", choices=("none", "before", "after"), default="none",
                   help="apply_activation_checkpointing to each layer, before or after fully_shard")
    p.add_argument("--root_reshard_after_forward", choices=("default", "true", "false"), default="default")
    p.add_argument("--explicit_prefetch", action="store_true",
                   help="set_modules_to_forward_prefetch / _backward_prefetch to the neighbouring layers")
    p.add_argument("--save_every", type=int, default=0, help="DCP checkpoint every N steps (0: never)")
    p.add_argument("--checkpoint_dir", default="fsdp2_llama_checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--init_from", default=None, help="a full state dict (torch.save) to start from, loaded the "
                   "FSDP2 way: distribute_tensor + load_state_dict(assign=True)")
    p.add_argument("--metrics_out", default=None, help="write the losses (and the run's figures) as JSON")
    p.add_argument("--save_full", default=None, help="after training, save the full state dict (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP: replicate over R groups of devices, shard within each (a 2-D mesh)")
    return p.parse_args(argv)


def build(args):
    cfg = PRESETS[args.preset]
    seq_len = args.seq_len or cfg.max_seq_len
    with torch.device("meta"):
        model = Llama(cfg)
    if args.activation_checkpointing == "before":
        apply_checkpointing(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    shard = {"mp_policy": mp}
    if args.hsdp > 1:
        import torch_xla.runtime as xr
        from torch.distributed.device_mesh import init_device_mesh

        devices = xr.global_runtime_device_count()  # XLA: the mesh covers devices (a process drives all of its own)
        shard["mesh"] = init_device_mesh("xla", (args.hsdp, devices // args.hsdp),
                                         mesh_dim_names=("dp_replicate", "dp_shard"))
    if args.offload:
        shard["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, **shard)
    root_raf = {"default": None, "true": True, "false": False}[args.root_reshard_after_forward]
    fully_shard(model, reshard_after_forward=root_raf, **shard)
    if args.activation_checkpointing == "after":
        apply_checkpointing(model)
    if args.explicit_prefetch:
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            inner = getattr(layer, "_checkpoint_wrapped_module", layer)
            if i + 1 < len(layers):
                inner.set_modules_to_forward_prefetch([getattr(layers[i + 1], "_checkpoint_wrapped_module",
                                                               layers[i + 1])])
            if i > 0:
                inner.set_modules_to_backward_prefetch([getattr(layers[i - 1], "_checkpoint_wrapped_module",
                                                                layers[i - 1])])
    device = torch_xla.device()  # XLA: was torch.device("cuda", local_rank)
    if args.init_from:
        from torch.distributed.tensor import distribute_tensor

        full = torch.load(args.init_from, map_location="cpu", weights_only=True)
        meta_sd = model.state_dict()
        sharded = {k: distribute_tensor(full[k], meta_sd[k].device_mesh, meta_sd[k].placements)
                   if hasattr(meta_sd[k], "device_mesh") else full[k] for k in full}
        model.load_state_dict(sharded, assign=True)
        model.to_empty(device=device)  # the buffers (rotary tables)
        with torch.no_grad():
            cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device=device)
            model.rope_cos.copy_(cos)
            model.rope_sin.copy_(sin)
            model.causal_mask.copy_(causal_mask(cfg.max_seq_len, device))
    else:
        model.to_empty(device=device)
        model.reset_parameters()
    torch_xla.sync()  # XLA: run the initialization now, not as part of the first training step
    return model, cfg, seq_len, device


def apply_checkpointing(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, DecoderLayer))


def progress_bar(start: int, total: int):
    """A tqdm bar on a terminal (loss and tokens/s beside it); None elsewhere, where each step is a line."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def main(argv=None):
    args = parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="xla://")  # XLA: was init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    # the corpus first: compiling pydoc_data's 0.5 MB module after the XLA runtime has started its
    # threads can overflow the main thread's stack on some machines
    blocks = token_blocks(args.seq_len or PRESETS[args.preset].max_seq_len)
    model, cfg, seq_len, device = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if rank == 0:
        where = sorted({p.device.type for p in model.parameters()})
        print(f"{sum(p.numel() for p in model.parameters()):,} parameter elements, held on: "
              f"{', '.join(where)}; placements {next(model.parameters()).placements}", flush=True)

    def lr_at(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    start = 0
    found = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if found is not None:
        start = load(found[1], model, optimizer, scheduler)
        if rank == 0:
            print(f"resumed from {found[1]} at step {start}", flush=True)

    sampler = torch.utils.data.DistributedSampler(blocks, num_replicas=world, rank=rank, shuffle=True,
                                                  seed=args.seed, drop_last=True)
    loader = torch.utils.data.DataLoader(blocks, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    batches = iter(())
    epoch = 0

    def next_batch():
        nonlocal batches, epoch
        for _ in range(2):
            try:
                return next(batches)
            except StopIteration:
                sampler.set_epoch(epoch)
                epoch += 1
                batches = iter(loader)
        raise RuntimeError("the corpus has fewer blocks than one batch")

    for _ in range(start):  # resume: the batches already trained on
        next_batch()
    losses, timing = [], {"t0": None, "tokens": 0}
    bar = progress_bar(start, args.steps) if rank == 0 else None

    def report(step, loss, grad_norm, lr):
        """One step's figures, read back one step late: the host never waits for the chips in between
        (and the ahead-of-time check, which traces the first two steps, reads nothing)."""
        losses.append(loss.item())
        rate = timing["tokens"] / max(time.perf_counter() - timing["t0"], 1e-9) if timing["tokens"] else 0.0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tokens_per_s=f"{rate:,.0f}")
        elif rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  grad_norm {grad_norm.item():.3f}  "
                  f"lr {lr:.2e}  {rate:,.0f} tokens/s", flush=True)

    pending = None
    for step in range(start, args.steps):
        batch = next_batch().to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        del logits  # XLA: a tensor alive at sync() is an output of the step (the logits: 3.9 GiB per chip at 1b)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad()
        torch_xla.sync()
        if timing["t0"] is None:
            timing["t0"] = time.perf_counter()  # from the end of the first (compiling) step
        else:
            timing["tokens"] += inputs.numel() * world
        if pending is not None:
            report(*pending)
        pending = (step, loss.detach(), grad_norm.detach(), lr)
        if args.save_every and (step + 1) % args.save_every == 0:
            save(args.checkpoint_dir, step + 1, model, optimizer, scheduler)
    if pending is not None:
        report(*pending)
    if bar is not None:
        bar.close()
    if args.save_full:
        full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, args.save_full)
    if args.metrics_out and rank == 0:
        with open(args.metrics_out, "w") as f:
            json.dump({"losses": losses, "start_step": start, "processes": world,
                       "devices": torch_xla.runtime.global_runtime_device_count()}, f)
    return losses


if __name__ == "__main__":
    main()
