"""run_clm end to end: flags -> data -> model -> engine -> loop -> report.

Order matters on XLA: the SPMD mode must be switched on before the first device tensor exists, and the optimizer must be
built from the parameters the engine returns (local shards), never from the unwrapped model."""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from xla_fsdp import abstract, metrics
from xla_fsdp.runtime import environment
from xla_fsdp.runtime.host_watch import HostLostError
from xla_fsdp.train import data, families, loop
from xla_fsdp.train.args import parse_args
from xla_fsdp.train.resume import Saves, exit_preempted, resume
from xla_fsdp.train.output_dir import check_output_dir, write_metrics, written_only_on_success
from xla_fsdp.train.model import (build_model, load_config, load_fsdp_config, selected_engine,
                                  single_controller, wants_deferred_init, wrap_model)


def device_facts(spmd: bool) -> dict:
    """Device type/kind, data-parallel degree, this rank, and chips counted for MFU."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    device_type = xr.device_type()
    if spmd:
        from xla_fsdp.runtime.hosts import host_view

        dp, rank, world = xr.global_runtime_device_count(), 0, 1
        host = host_view().index
        leader = host == 0  # one process per host: the first host logs and writes
    else:
        dp, rank, world = xr.world_size(), xr.global_ordinal(), xr.world_size()
        host = rank  # one process per device: each its own folder where every process writes
        leader = rank == 0
    kind = xm.xla_device_kind() if device_type == "TPU" else device_type
    # On CPU the measured peak is the whole host's, so the host is the "chip"; virtual CPU devices share its cores.
    chips = dp if device_type != "CPU" else max(xr.process_count(), 1)
    return {"device_type": device_type, "device_kind": kind, "data_parallel": dp,
            "rank": rank, "world": world, "chips": chips, "leader": leader, "host": host}


def run(argv=None) -> dict:
    """Train and/or evaluate as the flags say; returns the metrics written to metrics.json."""
    from xla_fsdp.checkpoint.preemption import Preemption

    args = parse_args(argv)
    # from the start: a signal while the model is built is kept for the first step boundary
    # ([Note: a signal becomes a checkpoint]). The check's traced job (per chip: ranks on threads, where no signal
    # reaches) ends inside its second step and never asks: it listens to nothing
    listening = contextlib.nullcontext() if abstract.active() else Preemption(grace_s=args.preemption_grace_s)
    with listening as preempted:
        with written_only_on_success(args.output_dir):
            job = _start(args)
        try:
            return _run(job, preempted)
        except HostLostError as e:
            # the job cannot go on, and the process's teardown would wait in gloo's destructors for the host that is
            # gone: say why and end here ([Note: a host that does not answer])
            print(f"run_clm: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


@dataclass
class StartedJob:
    """What `_start` hands to the steps: the wrapped model and how to feed, meter and report it."""
    args: object                    # run_clm's parsed flags
    model: torch.nn.Module          # the engine's wrapped model
    ctx: loop.StepContext
    meter: metrics.ThroughputMeter
    facts: dict                     # device_facts()
    log: Callable
    report: dict                    # metrics.json so far
    cache: Optional[str]            # the compile cache's folder, or None
    batches: Optional[data.BlockBatches]       # None without --do_train
    eval_batches: Optional[data.BlockBatches]  # None without --do_eval


@dataclass
class Runtime:
    """Where the job runs, decided once before the first device tensor."""
    engine: str        # "spmd" (GSPMD) or "collectives"
    spmd: bool         # the single controller: one process drives every device of the host
    device: object     # torch_xla's device
    facts: dict        # device_facts()
    log: Callable
    cache: Optional[str]  # the compile cache's folder, or None


def _start(args) -> StartedJob:
    """Everything before the first step, one stage at a time: the flags' files, the runtime, the model and its engine,
    the batches; a mistake in any of them ends the job here, before anything trains."""
    # XLA's C++ warnings (one GSPMD deprecation notice per compile) are not the user's to act on; errors still print,
    # and a TF_CPP_MIN_LOG_LEVEL the user set wins. Before torch_xla loads.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    config, corpus, fsdp_config = _inputs(args)
    rt = _runtime(args, fsdp_config)
    torch.manual_seed(args.seed)
    wrapped, deferred = _model(args, config, fsdp_config, rt)
    hosts = _host_batches(rt.spmd, wrapped.mesh)  # several SPMD hosts: each reads only its rows
    if hosts is not None:
        from xla_fsdp.runtime.hosts import host_group

        # the hosts' group from the start, not at the first save: a host lost in between is named at that save too
        # ([Note: a host that does not answer])
        host_group()
    facts = rt.facts
    ctx = loop.StepContext(rt.device, wrapped.mesh, bf16=args.bf16,
                           allreduce_grads=not wrapped.reduces_grads and facts["world"] > 1,
                           replicas=facts["world"], host_batches=hosts)  # replicas 1 under SPMD: one graph
    micro_batch = args.per_device_train_batch_size * facts["data_parallel"]  # one forward's batch
    if corpus is None:
        _trace_steps(wrapped.model, micro_batch, ctx, args, config, facts)  # never returns
    meter = _meter(args, config, micro_batch * args.gradient_accumulation_steps, facts, rt.log)
    report = _first_report(args, config, corpus, wrapped, rt, meter, micro_batch, deferred)
    batches = eval_batches = None
    if args.do_train:
        batches = data.BlockBatches(corpus.train, micro_batch, facts["rank"], facts["world"], args.seed,
                                    rows=hosts.rows(micro_batch) if hosts else None)
    if args.do_eval:
        eval_global = args.per_device_eval_batch_size * facts["data_parallel"]
        eval_batches = data.BlockBatches(corpus.eval, eval_global, facts["rank"], facts["world"], shuffle=False,
                                         rows=hosts.rows(eval_global) if hosts else None)
    return StartedJob(args, wrapped.model, ctx, meter, facts, rt.log, report, rt.cache, batches, eval_batches)


def _inputs(args):
    """The model config, the corpus (None when traced for the check) and the fsdp_config, read and checked before the
    XLA runtime starts: their errors come in seconds, not after device setup."""
    if not abstract.active():  # the ahead-of-time check writes nothing
        check_output_dir(args)
    config = load_config(args.config_name, args.attn_implementation)
    positions = config.max_position_embeddings  # GPT-2's n_positions
    args.block_size = args.block_size or min(positions, 1024)
    if args.block_size > positions:
        raise SystemExit(f"--block_size {args.block_size} exceeds {families.family(config.model_type).positions_key} "
                         f"{positions} of --config_name; lower --block_size")
    if args.attn_implementation == "pallas":
        from xla_fsdp.attention.rules import sequence_problem

        problem = sequence_problem(args.block_size)
        if problem:
            raise SystemExit(f"--block_size {args.block_size}: the Pallas attention kernel cannot take this "
                             f"sequence length ({problem}); pick e.g. 1024, or --attn_implementation eager")
    # traced for the ahead-of-time check: token values never matter, so nothing is downloaded
    try:
        corpus = None if abstract.active() else data.build_corpus(args, config.vocab_size)
    except ValueError as e:  # the text itself: a --train_file that cannot be read, or too short for a block
        raise SystemExit(str(e)) from None
    return config, corpus, load_fsdp_config(args.fsdp_config)


def _runtime(args, fsdp_config) -> Runtime:
    """The engine and the runtime (environment.runtime, via single_controller), the device, and the compile cache before
    the first program is compiled."""
    engine = selected_engine(fsdp_config)
    spmd = single_controller(engine)  # one process drives every device of the host

    import torch_xla
    import torch_xla.runtime as xr
    if spmd:
        xr.use_spmd()  # before the first device tensor
    device = torch_xla.device()
    facts = device_facts(spmd)
    log = print if facts["leader"] else (lambda *a, **k: None)
    if args.attn_implementation == "pallas" and facts["device_type"] != "TPU" and not abstract.active():
        raise SystemExit(f"--attn_implementation pallas runs torch_xla's Pallas kernel, which needs a TPU; this "
                         f"runs on {facts['device_type']}. Use --attn_implementation eager here (make train "
                         "does); check the TPU job without one: python -m xla_fsdp.aot --tpu v5e-8 -- "
                         "launch/run_clm.py <these flags>")
    return Runtime(engine, spmd, device, facts, log, _compile_cache(args, spmd, facts, log))


def _model(args, config, fsdp_config, rt: Runtime):
    """The model built (deferred where it is large or traced) and handed to its engine; the attention kernel's layout
    where it runs. Returns (wrapped, deferred)."""
    # traced for the ahead-of-time check: never build parameters on the host ([Note: abstract tracing])
    deferred = wants_deferred_init(config, args.deferred_init or abstract.active())
    model = build_model(config, deferred)
    from xla_fsdp.train.positions import use_sliced_positions

    use_sliced_positions(model)  # [Note: position embeddings as a slice]: GPT-2's, where it has them
    if args.fused_loss:
        from xla_fsdp.loss import use_fused_loss
        use_fused_loss(model)  # [Note: fused output loss]: the logits are never built whole
    wrapped = wrap_model(model, args, fsdp_config, rt.device, rt.engine, rt.spmd)
    if args.attn_implementation == "pallas":
        from xla_fsdp import attention

        # [Note: the kernel's sharding]: only a model that sees global tensors takes a partition spec
        global_tensors = rt.spmd and wrapped.engine != "collectives"
        attention.use_mesh(wrapped.mesh if global_tensors else None)
        if not global_tensors:
            # [Note: head-major projections]; under the GSPMD partitioner (global tensors) libtpu's check of the
            # kernel's operand shardings fails on them, so transformers' own run there
            from xla_fsdp.attention import gpt2_heads, llama_heads
            gpt2_heads.use_head_major(wrapped.model)
            llama_heads.use_head_major(wrapped.model)  # [Note: head-major Llama projections]
    return wrapped, deferred


def _first_report(args, config, corpus, wrapped, rt: Runtime, meter, micro_batch: int, deferred: bool) -> dict:
    """metrics.json's facts known before the first step, also said in three lines."""
    facts, log, spmd = rt.facts, rt.log, rt.spmd
    global_batch = micro_batch * args.gradient_accumulation_steps  # one optimizer step's
    num_params = metrics.num_params(config)
    report = {"params": num_params, "engine": wrapped.engine,
              "runtime": "single_controller" if spmd else "multi_process", "device": facts["device_kind"],
              "devices": facts["data_parallel"], "chips": facts["chips"],
              "peak_flops_per_chip": meter.peak.flops_per_chip, "peak_source": meter.peak.source,
              "global_batch": global_batch, "micro_batch": micro_batch, "block_size": args.block_size,
              "tokens_per_step": meter.tokens_per_step, "flops_per_step": meter.flops_per_step,
              "matmul_params": metrics.matmul_params(config),
              "mfu_includes_attention": args.mfu_include_attention, "data": corpus.source,
              "learning_rate": args.learning_rate, "optim": args.optim}
    log(f"run_clm: {num_params / 1e6:.2f}M params ({'deferred' if deferred else 'eager'} init), "
        f"engine {wrapped.engine} ({'single controller' if spmd else 'one process per device'}), "
        f"{facts['data_parallel']} x {facts['device_kind']}, "
        f"global batch {global_batch} x {args.block_size} tokens, optim {args.optim} "
        f"lr {args.learning_rate:g}")
    log(f"run_clm: data {corpus.source}: {corpus.train.shape[0]} train / {corpus.eval.shape[0]} eval blocks")
    log(f"run_clm: peak {meter.peak.flops_per_chip / 1e12:.3f} TFLOPS per chip x {meter.chips} ({meter.peak.source})")
    return report


def _run(job: StartedJob, preempted) -> dict:
    """The steps, the evaluation and the report of a started job."""
    args, ctx, facts, log, report, cache = job.args, job.ctx, job.facts, job.log, job.report, job.cache
    started = time.perf_counter()
    if job.batches is not None:
        report.update(_train(job.model, job.batches, ctx, job.meter, args, facts, log, preempted))
    if job.eval_batches is not None and "preempted" not in report:
        ev = loop.evaluate(job.model, job.eval_batches, ctx)
        report.update(ev)
        log(f"run_clm: eval loss {ev['eval_loss']:.4f}, perplexity {ev['perplexity']:.2f} "
            f"({ev['eval_batches']} batches)")
    report["wall_time_s"] = time.perf_counter() - started
    import torch_xla.debug.metrics as met

    compiles = met.metric_data("CompileTime")
    report["xla_compiles"] = int(compiles[0]) if compiles else 0  # a count growing with steps means recompiles
    if cache is not None:
        from xla_fsdp.runtime import compile_cache

        report["compile_cache"] = {"path": cache, **compile_cache.counts()}
        log(f"run_clm: {compile_cache.summary(cache)}")
    if facts["leader"]:
        path = write_metrics(report, args.output_dir)
        log(f"run_clm: metrics written to {path}")
    if "preempted" in report:
        exit_preempted(report["preempted"], log)
    return report


def _compile_cache(args, spmd: bool, facts: dict, log):
    """The persistent compilation cache's folder for this process, or None ([Note: the persistent compilation cache]):
    --compile_cache, else the compile-cache variable, else compile_cache/ under a local --output_dir; one folder per
    host under the single controller, per replica otherwise. The default is skipped, with a line saying why, in a
    process that compiled before the job started (run() called from a notebook or a test); one asked for by name ends
    the job then."""
    from xla_fsdp.checkpoint.filesystems import is_url
    from xla_fsdp.runtime import compile_cache

    if abstract.active():  # the ahead-of-time check compiles with libtpu, not here
        return None
    base = args.compile_cache or environment.get(compile_cache.ENV) or (
        None if is_url(args.output_dir) else os.path.join(args.output_dir, "compile_cache"))
    if base is None or base.lower() in compile_cache.OFF:
        return None
    part = f"host-{compile_cache.host_index()}" if spmd or facts["world"] == 1 else f"rank-{facts['rank']}"
    if args.compile_cache is None and compile_cache.too_late(os.path.join(base, part)):
        log("run_clm: no compile cache: this process compiled before the job started (give --compile_cache "
            f"or {compile_cache.ENV} in a fresh process)")
        return None
    try:
        return compile_cache.enable(base, part)
    except compile_cache.CompileCacheError as e:
        raise SystemExit(f"run_clm: {e}") from None


def _host_batches(spmd: bool, mesh):
    """Under SPMD on several hosts (or virtual hosts), what splits each global batch by host ([Note: per-host batches]);
    None with one host (the whole batch is copied and annotated, as ever) and with one process per chip. Positions stay
    step-derived: every host skips the same global batches on resume, each reading its own rows of the next."""
    if not spmd or mesh is None or abstract.active():  # the ahead-of-time check traces whole batches
        return None
    from xla_fsdp.data import HostBatches

    hosts = HostBatches(mesh)
    return None if hosts.single else hosts


def _meter(args, config, global_batch: int, facts: dict, log) -> metrics.ThroughputMeter:
    """Tokens and FLOPs per step, and the per-chip peak MFU is measured against."""
    try:
        peak = metrics.detect_peak(facts["device_type"], facts["device_kind"], args.peak_tflops)
    except ValueError as e:
        # An unknown chip must not stop training: report MFU as NaN instead.
        log(f"run_clm: no MFU: {e}")
        peak = metrics.Peak(float("nan"), "unknown (pass --peak_tflops)")
    tokens = metrics.tokens_per_step(global_batch, args.block_size)
    step_flops = metrics.flops_per_step(metrics.matmul_params(config), tokens, n_layer=config.num_hidden_layers,
                                        n_embd=metrics.attention_width(config),
                                        seq_len=args.block_size, include_attention=args.mfu_include_attention)
    return metrics.ThroughputMeter(tokens, step_flops, facts["chips"], peak)


def _train(model, batches, ctx, meter, args, facts, log, preempted) -> dict:
    """The training phase: optimizer, schedule, progress bar, loop, summary line."""
    per_epoch = loop.steps_per_epoch(batches, args.gradient_accumulation_steps)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
    log(f"run_clm: {total_steps} steps ({per_epoch} per epoch"
        + (f", {args.gradient_accumulation_steps} micro-batches each)" if args.gradient_accumulation_steps > 1 else ")"))
    optimizer = loop.make_optimizer(model.parameters(), args)
    scheduler = loop.make_scheduler(optimizer, args.warmup_steps, total_steps)
    start = resume(model, optimizer, scheduler, args, log)
    progress = loop.progress_bar(total_steps, facts["leader"])
    if progress and start:
        progress.update(start)
    saves = Saves(args, model, optimizer, scheduler)

    def boundary() -> bool:  # after every step: a save written beside training commits; a signal stops
        saves.poll()
        return preempted.agreed()

    from xla_fsdp.profiling import of_run_clm
    from xla_fsdp.train.report_to import open_reporter

    reporter = open_reporter(args, facts["leader"], log)
    ctx.keep_grad_norm = "tensorboard" in args.report_to  # every process: one program for all of them
    result = loop.train(model, optimizer, scheduler, batches, total_steps, ctx, meter, args,
                        log=progress.write if progress else log, progress=progress,
                        save=saves.save if args.save_strategy != "no" else None, start_step=start, stop=boundary,
                        profile=of_run_clm(args, facts["host"], log), on_log=reporter)
    if reporter is not None:
        reporter.close()
    if result.preempted and args.save_strategy == "no" and not result.nothing_to_save:
        saves.save(result.steps)  # --save_strategy no saves nothing else: this one is for the resume
    saves.wait()  # the last save's files are all written and committed before the job ends
    if progress:
        progress.close()
    report = dict(steps=result.steps, losses=result.losses, windows=result.windows, logged=result.logged,
                  train_wall_time_s=result.wall_time_s)
    if result.preempted:
        saved = os.path.join(args.output_dir, f"checkpoint-{result.steps}") if not result.nothing_to_save else None
        report["preempted"] = {"step": result.steps, "signal": preempted.signal_name or "another host's",
                               "checkpoint": saved}
        return {**report, **result.summary}
    if result.steps > start:
        from xla_fsdp.checkpoint import save_pretrained

        save_pretrained(model, args.output_dir)  # what Hugging Face's run_clm leaves: from_pretrained loads it
        log(f"run_clm: final model written to {args.output_dir} (config.json + model.safetensors)")
    if result.summary:
        s = result.summary
        log(f"run_clm: trained {result.steps} steps in {result.wall_time_s:.1f} s; loss "
            f"{result.losses[0][1]:.4f} -> {result.losses[-1][1]:.4f}; after {loop.WARMUP_STEPS} "
            f"warm-up steps: {s['tokens_per_s']:.0f} tokens/s, {s['step_time_s'] * 1e3:.1f} ms/step, "
            f"MFU {100 * s['mfu']:.2f}% of {meter.peak.flops_per_chip / 1e12:.3f} TFLOPS x {meter.chips}")
    return {**report, **result.summary}


def _trace_steps(model, micro_batch, ctx, args, config, facts) -> None:
    """Under the ahead-of-time check: training steps on token ids of the right shape, nothing read back, logged or
    saved; the check ends the process inside the second step's graph cut ([Note: two traced steps] in
    xla_fsdp/aot/capture.py)."""
    optimizer = loop.make_optimizer(model.parameters(), args)
    scheduler = loop.make_scheduler(optimizer, args.warmup_steps, max(args.max_steps, 2))
    local = micro_batch // facts["world"]
    print(f"run_clm: traced for the ahead-of-time check: {micro_batch} x {args.block_size} tokens per "
          f"micro-batch, {args.gradient_accumulation_steps} per step, synthetic token ids", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(3):  # the check stops the process in the second
        group = [torch.randint(config.vocab_size, (local, args.block_size), generator=gen)
                 for _ in range(args.gradient_accumulation_steps)]
        loop.train_step(model, optimizer, scheduler, group, ctx, args.max_grad_norm)
    raise SystemExit("run_clm: three traced steps ran without the ahead-of-time check stopping the process")
