"""Peak host memory of building a GPT-2 eagerly vs deferred + per-unit materialization.

Each mode runs in a fresh subprocess and reports its peak RSS (VmHWM) above
the RSS it had after imports, and that peak as a fraction of the model's fp32
bytes:

  eager     GPT2LMHeadModel(config): the whole model exists on the host.
  deferred  deferred_init(GPT2LMHeadModel, config), then, as an FSDP engine
            would, materialize one GPT2Block at a time and "shard" it: every
            parameter is replaced by a clone of its 1/world_size slice and the
            full tensor freed.  The remaining root unit (embeddings, final
            LayerNorm, tied head) goes last.
  fsdp      deferred_init, then xla_fsdp.XlaFullyShardedDataParallel with a
            GPT2Block auto-wrap policy on XLA:CPU (world size 1, so the whole
            model ends up in host memory as XLA buffers; what matters is that
            the peak does not double).

Usage:
  PJRT_DEVICE=CPU python bench/deferred_init_memory.py [--n_embd 1024 --n_layer 24]
      [--world_size 8] [--modes eager,deferred,fsdp]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import re
import subprocess
import sys
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


def _config(args):
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        vocab_size=args.vocab_size, n_positions=args.n_positions,
        bos_token_id=args.vocab_size - 1, eos_token_id=args.vocab_size - 1,
    )


def _model_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _shard_(module, world_size: int) -> None:
    """Keep only rank 0's dim-0 slice of each of ``module``'s own parameters."""
    import torch

    for name, p in list(module._parameters.items()):
        if p is None or p.is_meta:
            continue
        flat = p.detach().reshape(-1)
        shard = flat[: -(-flat.numel() // world_size)].clone()
        module._parameters[name] = torch.nn.Parameter(shard, requires_grad=p.requires_grad)


def _release_freed_memory(args) -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise).

    Full tensors freed after sharding stay in glibc's arenas and RSS keeps
    growing by about a unit per unit even though nothing holds them (measured:
    a weakref to every full parameter is dead, and malloc_trim returns the
    difference).  A training job would trim the same way after init.
    """
    if args.no_trim:
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _run_eager(args):
    from transformers import GPT2LMHeadModel

    start = time.perf_counter()
    model = GPT2LMHeadModel(_config(args))
    return _model_bytes(model), {"build_s": round(time.perf_counter() - start, 2)}


def _run_deferred(args):
    from transformers import GPT2LMHeadModel

    from xla_fsdp.deferred_init import deferred_init, is_deferred, materialize_module

    start = time.perf_counter()
    model = deferred_init(GPT2LMHeadModel, _config(args))
    record_s = time.perf_counter() - start
    after_record_kib = _status_kib("VmRSS")
    model_bytes = _model_bytes(model)

    start = time.perf_counter()
    blocks = list(model.transformer.h)
    inside = {id(m) for block in blocks for m in block.modules()}
    for block in blocks:
        materialize_module(block)
        for m in block.modules():
            _shard_(m, args.world_size)
        _release_freed_memory(args)
    materialize_module(model, check_fn=lambda m: id(m) not in inside)
    # Tied head and embedding are one parameter: shard it once, keep the tie.
    for m in model.modules():
        if id(m) not in inside and m is not model.lm_head:
            _shard_(m, args.world_size)
    model.lm_head.weight = model.transformer.wte.weight
    assert not is_deferred(model)
    return model_bytes, {
        "record_s": round(record_s, 2),
        "materialize_and_shard_s": round(time.perf_counter() - start, 2),
        "rss_after_record_mib": round(after_record_kib / 1024, 1),
        "malloc_trim_per_unit": not args.no_trim,
    }


def _run_fsdp(args):
    import torch_xla.core.xla_model as xm
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import xla_fsdp
    from xla_fsdp.deferred_init import deferred_init

    model = deferred_init(GPT2LMHeadModel, _config(args))
    model_bytes = _model_bytes(model)
    start = time.perf_counter()
    model = xla_fsdp.XlaFullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(
            xla_fsdp.transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}),
    )
    xm.mark_step()
    return model_bytes, {"wrap_s": round(time.perf_counter() - start, 2)}


MODES = {"eager": _run_eager, "deferred": _run_deferred, "fsdp": _run_fsdp}


def _warm_up(args) -> None:
    """Pay lazy imports and first-call costs before the baseline is taken."""
    import argparse as _argparse

    tiny = _argparse.Namespace(**{**vars(args), "n_embd": 8, "n_layer": 1, "n_head": 1,
                                  "vocab_size": 16, "n_positions": 8})
    from transformers import GPT2LMHeadModel

    from xla_fsdp.deferred_init import deferred_init, materialize_module

    GPT2LMHeadModel(_config(tiny))
    materialize_module(deferred_init(GPT2LMHeadModel, _config(tiny)))
    if args.mode == "fsdp":
        import torch_xla  # noqa: F401

        import xla_fsdp  # noqa: F401


def _child(args) -> None:
    import torch

    _warm_up(args)
    torch.manual_seed(0)
    baseline_kib = _status_kib("VmRSS")
    model_bytes, extra = MODES[args.mode](args)
    peak_kib = _status_kib("VmHWM")
    grown = (peak_kib - baseline_kib) * 1024
    print(json.dumps({
        "mode": args.mode,
        "model_mib": round(model_bytes / 2**20, 1),
        "baseline_rss_mib": round(baseline_kib / 1024, 1),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "peak_above_baseline_mib": round(grown / 2**20, 1),
        "peak_above_baseline_over_model": round(grown / model_bytes, 3),
        **extra,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=24)
    parser.add_argument("--n_head", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=50257)
    parser.add_argument("--n_positions", type=int, default=1024)
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--modes", default="eager,deferred")
    parser.add_argument("--no_trim", action="store_true",
                        help="deferred mode: do not malloc_trim after each unit")
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.world_size < 1:
        parser.error(f"--world_size must be >= 1, got {args.world_size}")
    if args.mode:
        _child(args)
        return
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(sorted(MODES))}")
        argv = [f"--{k}={getattr(args, k)}" for k in
                ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions", "world_size")]
        argv += ["--no_trim"] if args.no_trim else []
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv, "--mode", mode],
            capture_output=True, text=True,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if result.returncode != 0 or not lines:
            print(f"{mode}: failed (exit {result.returncode})\n{result.stderr[-3000:]}")
            continue
        print(lines[-1])


if __name__ == "__main__":
    main()
