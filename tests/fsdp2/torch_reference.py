"""Independent references for the FSDP2 tests: PyTorch's own FSDP2 on the CPU.

tests/test_fsdp2.py and tests/test_fsdp2_port.py compare what xla_fsdp.fsdp trains on N XLA:CPU
devices with what `torch.distributed.fsdp.fully_shard` trains here: W CPU processes, one gloo
rank each (127.0.0.1), from the same initial weights on the same data. Neither torch_xla nor
xla_fsdp is imported in the ranks (each checks at its end, and says so in its result), so a bug
in xla_fsdp shared by every device count cannot be in the reference too.

  torch_reference.py example OUT_DIR --world W --init INIT.pt --blocks BLOCKS.pt --steps N [--bf16] [--hsdp R]
        examples/fsdp2_llama.py's Llama (its model classes taken from the example's source; the
        example's imports are not run), trained as the example trains it with its defaults (AdamW
        lr 3e-3, weight decay 0.1, betas (0.9, 0.95), 5 warmup steps then a cosine to 0.1, clipping
        at 1.0), on the global batch of 8 blocks the example reads as one process (its
        DistributedSampler at world 1, seed 0), split over the W ranks on dim 0. --bf16: the
        example's MixedPrecisionPolicy(bfloat16 params, float32 reduce); --hsdp R: a (R, W // R)
        ("dp_replicate", "dp_shard") mesh. Writes OUT_DIR/metrics.json (the losses: the mean over
        the global batch) and OUT_DIR/full.pt (the full state dict after training).
  torch_reference.py port OUT_DIR --world W -- FIXTURE_ARGS...
        tests/fixtures/fsdp2_gpu_port.py with each `# was:` line restored (the GPU script it was
        ported from), then made to run on the CPU: torch.device("cuda", local_rank) becomes
        torch.device("cpu") and init_process_group("nccl") becomes init_process_group("gloo").
        The script is written to OUT_DIR/fsdp2_gpu_script.py and run with torchrun's variables.
  torch_reference.py port-init OUT.pt
        the initial weights both sides of the port's comparison load (--load_full): the GPU
        script's Decoder at its default sizes, reset_parameters() on the CPU. (Initialized on the
        devices, the two would differ: torch_xla draws from its own generator.)

Each mode starts its W ranks itself and exits non-zero if any rank fails.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import socket
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "fsdp2_llama.py")
PORT = os.path.join(ROOT, "tests", "fixtures", "fsdp2_gpu_port.py")
# the example's model, by name: everything its Llama needs, nothing else of the script
MODEL_NAMES = ("LlamaConfig", "RMSNorm", "rotary_tables", "causal_mask", "rotate", "Attention", "FeedForward",
               "DecoderLayer", "Llama")
BATCH = 8  # the example's --batch_size (per process; the XLA run is one process)
# the GPU lines a CPU run cannot have, and what they become on the CPU (each must occur once)
ON_CPU = {'torch.device("cuda", local_rank)': 'torch.device("cpu")',
          'dist.init_process_group("nccl")': 'dist.init_process_group("gloo")'}


# ---------------------------------------------------------------------------- the example's model
def example_model_module() -> types.ModuleType:
    """The example's model classes, compiled from its source without running its imports."""
    import dataclasses

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    with open(EXAMPLE) as f:
        tree = ast.parse(f.read(), EXAMPLE)
    body = [node for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in MODEL_NAMES]
    missing = set(MODEL_NAMES) - {node.name for node in body}
    if missing:
        raise RuntimeError(f"{EXAMPLE} no longer defines {sorted(missing)}")
    module = types.ModuleType("fsdp2_llama_model")
    module.__dict__.update(torch=torch, nn=nn, F=F, math=math, dataclass=dataclasses.dataclass)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=body, type_ignores=[]), EXAMPLE, "exec"), module.__dict__)
    return module


def lr_at(step: int, steps: int, warmup: int = 5) -> float:
    """The example's schedule (its lr_at): linear warmup, then a cosine down to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def global_batches(blocks, steps: int):
    """The example's batches at world 1: DistributedSampler(shuffle, seed 0, drop_last), batches of
    BATCH, a new epoch (set_epoch) when one runs out."""
    import torch

    sampler = torch.utils.data.DistributedSampler(blocks, num_replicas=1, rank=0, shuffle=True, seed=0,
                                                  drop_last=True)
    out, epoch = [], 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        epoch += 1
        order = list(sampler)
        out.extend(blocks[order[i:i + BATCH]] for i in range(0, len(order) - BATCH + 1, BATCH))
    return out[:steps]


def example_rank(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    ex = example_model_module()
    model = ex.Llama(ex.LlamaConfig())
    model.load_state_dict(torch.load(args.init, weights_only=True))
    if args.hsdp > 1:
        mesh = init_device_mesh("cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, args.steps))
    per_rank = BATCH // world
    losses, norms = [], []
    for batch in global_batches(torch.load(args.blocks, weights_only=True), args.steps):
        mine = batch[rank * per_rank:(rank + 1) * per_rank]
        inputs, targets = mine[:, :-1], mine[:, 1:]
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the ranks' batches are equal parts of the global one
        losses.append(mean.item() / world)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(args.out, "full.pt"))
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "processes": world, "devices": "cpu",
                       "placements": [str(p) for p in next(model.parameters()).placements],
                       "independent": independent()}, f)


def independent() -> bool:
    """Whether this process ran without torch_xla and xla_fsdp."""
    return not any(name == m or name.startswith(m + ".") for name in sys.modules for m in ("torch_xla", "xla_fsdp"))


# ---------------------------------------------------------------------------- the port's GPU script
def restored_port() -> str:
    """The port fixture with each `# was:` line restored, then made to run on the CPU (ON_CPU)."""
    with open(PORT) as f:
        lines = f.read().splitlines()
    out, restored = [], 0
    for line in lines:
        m = re.match(r"^(\s*)(\S.*?)  # was: (.*)$", line)
        if not m:
            out.append(line)
            continue
        indent, now, was = m.groups()
        restored += 1
        if was.endswith("..."):  # `from torch.distributed.fsdp import ...`: the same names
            was = was[:-3] + now.split(" import ", 1)[1]
        elif re.match(r"^\w+ = ", now) and not re.match(r"^\w+ = ", was):  # the right-hand side only
            was = now.split(" = ", 1)[0] + " = " + was
        out.append(indent + was)
    text = "\n".join(out) + "\n"
    if restored != 3:
        raise RuntimeError(f"{PORT}: {restored} `# was:` lines, expected the README's 3")
    for gpu, cpu in ON_CPU.items():
        if text.count(gpu) != 1:
            raise RuntimeError(f"the restored GPU script has {text.count(gpu)} of {gpu!r}, expected 1")
        text = text.replace(gpu, cpu)
    for name in ("xla_fsdp", "torch_xla", '"xla"', "xla://"):
        if name in text:
            raise RuntimeError(f"the restored GPU script still says {name}")
    return text


def port_init(out: str) -> None:
    """The GPU script's Decoder (its default sizes) initialized on the CPU, saved as a full state dict."""
    import torch

    script = types.ModuleType("fsdp2_gpu_script")
    exec(compile(restored_port(), PORT, "exec"), script.__dict__)
    with open(PORT) as f:  # the script's defaults, from its argparse lines
        sizes = {k: int(v) for k, v in re.findall(
            r'add_argument\("--(vocab|dim|heads|layers|seq)", type=int, default=(\d+)\)', f.read())}
    model = script.Decoder(**{k: sizes[k] for k in ("vocab", "dim", "heads", "layers", "seq")})
    model.reset_parameters()
    torch.save(model.state_dict(), out)


# ---------------------------------------------------------------------------- ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, argv: list, out: str) -> int:
    """Run `argv` (a Python command line) as `world` ranks with torchrun's variables; the exit
    status (the first non-zero of the ranks'); each rank's output in OUT/rank<i>.log. The
    example's ranks meet through a file store in OUT (no port to race for); the port's script
    calls init_process_group("gloo") as a GPU script does, through MASTER_ADDR and MASTER_PORT."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", REFERENCE_STORE=os.path.join(out, "store"))
        for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FSDP_RUNTIME", "XLA_FLAGS"):
            env.pop(name, None)
        log = open(os.path.join(out, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.log")) as f:
            tail = f.read()[-3000:]
        if codes[rank]:
            print(f"-- rank {rank} exited {codes[rank]}:\n{tail}", flush=True)
    return next((c for c in codes if c), 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("example", "port", "port-init", "example-rank"))
    p.add_argument("out")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--init")
    p.add_argument("--blocks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--hsdp", type=int, default=1)
    args, rest = p.parse_known_args()
    if args.mode == "example":
        os.makedirs(args.out, exist_ok=True)
        if os.path.exists(os.path.join(args.out, "store")):
            os.remove(os.path.join(args.out, "store"))  # a file store serves one group only
        argv = [os.path.abspath(__file__), "example-rank", *sys.argv[2:]]
        return launch(args.world, argv, args.out)
    if args.mode == "port-init":
        port_init(args.out)
        return 0
    if args.mode == "port":
        os.makedirs(args.out, exist_ok=True)
        script = os.path.join(args.out, "fsdp2_gpu_script.py")
        with open(script, "w") as f:
            f.write(restored_port())
        return launch(args.world, [script, *(rest[1:] if rest[:1] == ["--"] else rest)], args.out)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.environ["REFERENCE_STORE"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        example_rank(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
