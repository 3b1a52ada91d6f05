"""The training and evaluation loops of run_clm, written for lazy XLA tensors.

One `torch_xla.sync()` per step cuts the graph; the loss is copied to the host only at logging steps, because every host
read waits for the device and would serialize the otherwise asynchronous step pipeline."""
from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch

from xla_fsdp.metrics import ThroughputMeter

# Steps excluded from throughput: step 1 compiles the forward/backward graph, step 2 compiles again because the
# optimizer state now exists.
WARMUP_STEPS = 2


def make_optimizer(params, args):
    """AdamW (HF default) or Adafactor (the 2023 recipe's `--optim adafactor`).

    Adafactor is Hugging Face's, configured as HF Trainer does for `--optim adafactor` (fixed lr, no parameter scaling).
    torch.optim.Adafactor is not usable on XLA: it calls `.item()` on every parameter's norm each step, and every host
    read there cuts and runs a separate small graph."""
    params = list(params)
    if args.optim == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=args.learning_rate, weight_decay=args.weight_decay,
                         scale_parameter=False, relative_step=False, warmup_init=False)
    # foreach=False: the per-tensor loop traces to the same XLA graph and avoids foreach kernels' host-side grouping by
    # device and dtype.
    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, foreach=False)


def make_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """Linear warmup then linear decay to 0 (HF's default `linear` schedule)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(warmup_steps, 1)
        return max(0.0, (total_steps - step) / max(total_steps - warmup_steps, 1))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class StepContext:
    """What the loop needs to know about devices and layout."""
    device: torch.device
    spmd_mesh: object = None            # shard batches on dim 0 over this mesh
    allreduce_grads: bool = False       # plain replication across collective ranks
    bf16: bool = False
    replicas: int = 1                   # processes whose losses are averaged for logging
    host_batches: object = None         # several SPMD hosts: `batch` is this host's rows (HostBatches)
    keep_grad_norm: bool = False        # hold each step's gradient norm (before clipping) for the log
    grad_norm: object = None            # the last step's, when kept (a device tensor; None without clipping)

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.host_batches is not None:  # the global batch from every host's rows
            return self.host_batches.to_global(batch)
        batch = batch.to(self.device)
        if self.spmd_mesh is not None:
            import torch_xla.distributed.spmd as xs
            from xla_fsdp.runtime.mesh import batch_spec
            xs.mark_sharding(batch, self.spmd_mesh, batch_spec(batch, self.spmd_mesh))
        return batch

    def replica_mean(self, value: torch.Tensor) -> torch.Tensor:
        """`value` averaged over the data-parallel replicas.

        With one process per device (the collectives engine) each replica computes the loss of its own micro-batch (or
        eval slice); the logged figure must be the global one. Under SPMD one graph already computes the global loss,
        and `replicas` is 1. Called only where the value is read anyway (logging steps, end of eval), so the all-reduce
        adds no collective to the training step's graph."""
        if self.replicas <= 1:
            return value
        import torch_xla.core.xla_model as xm
        return xm.all_reduce(xm.REDUCE_SUM, value, scale=1.0 / self.replicas)

    def autocast(self):
        return torch.autocast("xla", dtype=torch.bfloat16) if self.bf16 else nullcontext()


@dataclass
class TrainResult:
    steps: int = 0
    losses: list = field(default_factory=list)      # [step, loss] at logging steps
    windows: list = field(default_factory=list)     # per-logging-window throughput
    logged: list = field(default_factory=list)      # what each logging step reported ([Note: one record per log])
    summary: dict = field(default_factory=dict)     # throughput over steps after warmup
    wall_time_s: float = 0.0
    preempted: bool = False  # left at a step boundary for a signal ([Note: a signal becomes a checkpoint])
    nothing_to_save: bool = False  # preempted before the run's first step ended or right after it


def _sync():
    import torch_xla
    torch_xla.sync()


def _wait():
    import torch_xla.core.xla_model as xm
    xm.wait_device_ops()


def _clip(model, max_norm: float):
    """Clip to `max_norm` (0: not at all); returns the gradients' norm before clipping, or None."""
    if max_norm <= 0:
        return None
    clip = getattr(model, "clip_grad_norm_", None)  # sharded engines: norm across shards
    return clip(max_norm) if clip is not None else torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def train_step(model, optimizer, scheduler, micro_batches, ctx: StepContext, max_grad_norm: float):
    """One optimizer step over `micro_batches` (--gradient_accumulation_steps of them), traced lazily and cut by one
    sync; returns the step's loss (their mean) as a device tensor.

    Gradients accumulate the XLA-friendly way: each micro-batch's backward reduce-scatters and the shard gradients add
    up (1/N memory, a collective per micro-batch), in the same graph as the optimizer step. `model.no_sync()` would skip
    those collectives at the cost of full-size gradients on every device."""
    loss = 0.0
    for batch in micro_batches:
        input_ids = ctx.to_device(batch)
        with ctx.autocast():
            micro = model(input_ids=input_ids, labels=input_ids).loss / len(micro_batches)
        micro.backward()
        loss = loss + micro.detach()
    if ctx.allreduce_grads:
        import torch_xla.core.xla_model as xm
        xm.reduce_gradients(optimizer)
    norm = _clip(model, max_grad_norm)
    if ctx.keep_grad_norm:  # held every step, so the step's program is the same at every step
        ctx.grad_norm = None if norm is None else norm.detach()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    _sync()
    return loss.detach()


def steps_per_epoch(batches, accumulate: int) -> int:
    """Optimizer steps in one pass over `batches` (a partial last group is dropped, as HF does)."""
    return max(len(batches) // accumulate, 1)


def train(model, optimizer, scheduler, batches, total_steps: int, ctx: StepContext,
          meter: ThroughputMeter, args, log=print, progress=None, save=None, start_step: int = 0,
          stop=None, profile=None, on_log=None) -> TrainResult:
    """Run optimizer steps `start_step`..`total_steps` over `batches` (a `BlockBatches`).

    The loss is read on the first step, every `--logging_steps` and on the last step; throughput windows close at those
    reads. `save(step)`, if given, is called per `--save_strategy` and after the last step. A resumed run (`start_step`
    > 0) skips the batches the saved run already used, so it sees the same data in the same order. `stop()`, if given,
    is asked before the first step and after every step (every host the same answer): True ends the loop there, saved as
    after the last step (`result.preempted`); stopped before or right after the first step, nothing is saved (at most
    one step to redo, and the grace period may be spent compiling it). `profile` (a `xla_fsdp.profiling.ProfileSteps`)
    is told before and after each step. `on_log(record)`, if given, gets each logging step's record (also kept in
    `result.logged`: [Note: one record per log])."""
    result = TrainResult()
    started = time.perf_counter()
    model.train()
    step = start_step
    accumulate = args.gradient_accumulation_steps
    epoch, skip = divmod(start_step, steps_per_epoch(batches, accumulate))
    log_every = args.logging_steps if args.logging_strategy == "steps" else None
    result.preempted = stop is not None and stop()  # a signal while the job was set up
    while step < total_steps and not result.preempted:
        loss = None
        micro_batches = []
        for index, batch in enumerate(batches.epoch(epoch)):
            if index < skip * accumulate:
                continue
            micro_batches.append(batch)
            if len(micro_batches) < accumulate:
                continue
            if profile is not None:
                profile.before(step + 1)
            loss = train_step(model, optimizer, scheduler, micro_batches, ctx, args.max_grad_norm)
            micro_batches = []
            step += 1
            if profile is not None:
                profile.after(step)
            if progress is not None:
                progress.update(1)
            if step == start_step + WARMUP_STEPS:
                _wait()
                meter.restart(step)
            if step == start_step + 1 or (log_every and step % log_every == 0) or step == total_steps:
                line = _record(result, step, total_steps, ctx.replica_mean(loss), scheduler, meter,
                               warm=step > start_step + WARMUP_STEPS, grad_norm=ctx.grad_norm)
                if log_every or step == total_steps:
                    log(line)
                if on_log is not None:
                    on_log(result.logged[-1])
            if save and args.save_strategy == "steps" and step % args.save_steps == 0 and step < total_steps:
                save(step)
            if step >= total_steps:
                break
            if stop is not None and stop():
                result.preempted = True
                break
        if result.preempted:
            break
        if args.logging_strategy == "epoch" and loss is not None:
            log(f"epoch {epoch} done at step {step}: loss {ctx.replica_mean(loss).item():.4f}")
        if save and args.save_strategy == "epoch" and step < total_steps:
            save(step)
        epoch, skip = epoch + 1, 0
    _wait()
    result.steps, result.wall_time_s = step, time.perf_counter() - started
    result.summary = meter.summary(step)
    result.nothing_to_save = result.preempted and step <= start_step + 1
    if save and step > start_step and not result.nothing_to_save:
        save(step)  # after the clocks stop: saving is not training throughput
    return result


# [Note: one record per log] Each logging step's figures are one record, kept in metrics.json's "logged" and handed to
# the reporters (--report_to tensorboard), so both say the same values: step, loss, learning_rate, memory_bytes (device
# memory in use on a TPU where PJRT reports it, the process's resident memory on CPU), grad_norm (before clipping; with
# --max_grad_norm > 0 and a reporter), and, after the warm-up steps, tokens_per_s, step_time_s and mfu of the window
# that ends there.
def _record(result: TrainResult, step: int, total_steps: int, loss, scheduler, meter, warm: bool,
            grad_norm=None) -> str:
    """Read the loss (the one host read: it waits for this step), close the throughput window, keep the step's record,
    and return the log line."""
    value = loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"loss is {value} at step {step}; lower --learning_rate or raise --warmup_steps")
    result.losses.append([step, value])
    lr = scheduler.get_last_lr()[0]
    record = {"step": step, "loss": value, "learning_rate": lr}
    in_use = memory_in_use()
    if in_use is not None:
        record["memory_bytes"] = in_use
    if grad_norm is not None:
        record["grad_norm"] = grad_norm.item()
    line = f"step {step}/{total_steps} loss {value:.4f} lr {lr:.2e}"
    if warm:
        window = dict(meter.close(step), step=step)
        result.windows.append(window)
        record.update({k: window[k] for k in ("tokens_per_s", "step_time_s", "mfu")})
        line += (f" | {window['tokens_per_s']:.0f} tokens/s, {window['step_time_s'] * 1e3:.1f} ms/step, "
                 f"MFU {100 * window['mfu']:.2f}%")
    result.logged.append(record)
    return line


def memory_in_use() -> Optional[int]:
    """Bytes in use: the device's on a TPU, else this process's resident memory. None where the device cannot say: the
    SPMD runtime's virtual device has no allocator figures (PJRT raises, as xla_fsdp/memory/device_figures.py meets
    too), and a log line must not end the job."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if xr.device_type() == "TPU":
        try:
            return int(xm.get_memory_info(torch_xla.device())["bytes_used"])
        except RuntimeError:
            return None
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@torch.no_grad()
def evaluate(model, batches, ctx: StepContext) -> dict:
    """Mean causal-LM loss over the eval blocks, and its perplexity."""
    model.eval()
    total, count = None, 0
    for batch in batches.epoch(0):
        input_ids = ctx.to_device(batch)
        with ctx.autocast():
            loss = model(input_ids=input_ids, labels=input_ids).loss.detach().float()
        total = loss if total is None else total + loss
        count += 1
        _sync()
    model.train()
    mean = ctx.replica_mean(total / count).item()
    return {"eval_loss": mean, "perplexity": math.exp(min(mean, 50.0)), "eval_batches": count}


def progress_bar(total: int, is_master: bool):
    """tqdm's bar of the training steps on the process that logs (None elsewhere, or without tqdm)."""
    if not is_master:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: fall back to plain log lines
        return None
    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
