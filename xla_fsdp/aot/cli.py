"""`python -m xla_fsdp.aot`: check a training job for a Cloud TPU slice from this host.

    python -m xla_fsdp.aot --tpu v4-8 [--runtime auto] [--json] [--dump DIR] -- \\
        launch/run_clm.py <the job's flags>

When the single controller's default rings do not fit, the check traces and compiles the step again with the
rings variable at 0 (`environment.RINGS`) and reports whether that fits ([Note: rings off for the last GiB]).

Exit codes: 0 compiles and fits; 1 does not fit in HBM (as given); 2 bad input; 3 the job failed to trace; 4 the
TPU compiler refused the step; 5 libtpu missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

from xla_fsdp.aot import program as prog
from xla_fsdp.aot import report as rep
from xla_fsdp.aot import step_page, trace
from xla_fsdp.aot.dump import BUFFER_ASSIGNMENT, RECOMPUTE, TENSORS
from xla_fsdp.memory import fit
from xla_fsdp.memory.device_figures import MEMORY_ENV
from xla_fsdp.memory.host import release_freed_host_memory
from xla_fsdp.runtime import allocator, environment
from xla_fsdp.tpu import libtpu_flags, topology

EXIT_OK, EXIT_NO_FIT, EXIT_USAGE, EXIT_TRACE, EXIT_COMPILE, EXIT_NO_LIBTPU = 0, 1, 2, 3, 4, 5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xla_fsdp.aot",
        usage="%(prog)s --tpu TYPE [options] -- SCRIPT [SCRIPT_ARGS ...]",
        description="Trace one training step of a job at a TPU slice's size on this host (nothing runs) "
                    "and compile it with libtpu's own compiler: does it compile, does it fit in HBM, "
                    "which collectives run beside compute.")
    p.add_argument("--tpu", required=True, help="accelerator type as Cloud TPU names it: v4-8, v4-32, v5e-8 "
                   "(v5litepod-8), v5p-8, v6e-8, ...")
    p.add_argument("--num_slices", type=int, default=1, help="Multislice: the job runs on this many slices of "
                   "--tpu's type, joined over the data-center network (DCN); the report splits ICI and DCN bytes "
                   "(default 1)")
    p.add_argument("--dcn_gbps", type=float, default=None, help="with --num_slices: DCN bandwidth per host in Gbit/s "
                   "the step is projected with (default: Cloud TPU's documented figure for the chip, "
                   "xla_fsdp/tpu/chips.py; docs/pods.md)")
    p.add_argument("--runtime", default="auto", help="auto (what the command uses on a TPU, as xla_spawn "
                   f"chooses: --spmd / --per_chip, else ${environment.RUNTIME}, else what the script declares "
                   f"({environment.SCRIPT_MARKER}; run_clm: the single controller), else one process per chip), "
                   "single_controller or multi_process")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--dump", metavar="DIR", help="keep the traced module and the TPU-optimized HLO in DIR")
    p.add_argument("--steps", type=int, default=2, help="training steps the job runs before the checked one "
                   "is cut (default 2: the second, steady-state step; 1: the first, for loops that read "
                   "values back in their first step)")
    p.add_argument("--libtpu-flags", default=None, help="libtpu flags for the compile, as in LIBTPU_INIT_ARGS "
                   "(default: $LIBTPU_INIT_ARGS, else the async-collective flags xla_fsdp sets on a TPU for the runtime checked, "
                   "xla_fsdp.tpu.libtpu_flags; --libtpu-flags '' compiles with none)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for tracing (default 3600)")
    p.add_argument("--quiet", action="store_true", help="do not echo the job's own output while tracing")
    p.add_argument("--timeline", metavar="HTML", help="write a page picturing the PROJECTED step: a timeline of "
                   "compute and every collective, HBM in use, the kernels with the most time, the memory "
                   "breakdown (one self-contained file; a name ending in .svg: the timeline alone)")
    return p


def split_command(argv: List[str]):
    """(our flags, the job's command): everything after the first `--` is the job's."""
    i = argv.index("--") if "--" in argv else len(argv)
    return argv[:i], argv[i + 1:]


def _load_compiler():
    """libtpu's compiler, loaded with its start-up chatter kept off the terminal (off a TPU VM it prints that it
    could not determine the accelerator type, which says nothing about the check); replayed if loading fails."""
    from xla_fsdp.tpu import pjrt

    saved, sink = os.dup(2), tempfile.TemporaryFile()
    sys.stderr.flush()
    os.dup2(sink.fileno(), 2)
    try:
        return pjrt.get_compiler()
    except BaseException:
        os.dup2(saved, 2)
        sink.seek(0)
        sys.stderr.write(sink.read().decode(errors="replace"))
        raise
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        sink.close()


def _rings_to_retry(result: dict, text: str, job, spec, opts) -> bool:
    """The step does not fit, and it is the single controller's default rings under xla_fsdp's own flags: the
    configuration the rings variable at 0 switches to may fit ([Note: rings off for the last GiB])."""
    no_fit = bool(result.get("does_not_fit")) or (result["compiles"] and not result["fits"])
    return (no_fit and job.runtime == trace.SINGLE_CONTROLLER and spec.chips <= libtpu_flags.RING_MAX_CHIPS
            and opts.libtpu_flags is None and not libtpu_flags.users_own() and libtpu_flags.rings_enabled()
            and prog.ring_ops(text) > 0)


def write_dump(dump: str, workdir: str, optimized_hlo: Optional[str]) -> None:
    """--dump DIR: traced module, TPU-optimized HLO and trace log, to a folder or URL, via the checkpoints' storage."""
    from xla_fsdp.checkpoint import storage

    st = storage.storage_for(dump)
    st.makedirs(dump, exist_ok=True)
    if optimized_hlo:
        st.write_bytes(st.join(dump, "tpu_optimized.hlo.txt"), optimized_hlo.encode())
    for name, kept_as in (("program.txt", "traced_step.hlo.txt"), ("trace.log", "trace.log"),
                          (BUFFER_ASSIGNMENT, BUFFER_ASSIGNMENT)):
        path = os.path.join(workdir, name)
        if name != BUFFER_ASSIGNMENT or os.path.exists(path):  # libtpu's buffer assignment, when it wrote one
            with open(path, "rb") as f:
                st.write_bytes(st.join(dump, kept_as), f.read())


def _without_rings(job, spec, compiler, workdir: str, opts, say) -> dict:
    """Trace and compile the step again with the rings variable at 0; the summary of that report."""
    switch = {libtpu_flags.RINGS_ENV: "0"}
    say(f"xla_fsdp.aot: the default's rings do not fit; checking the step again with "
        f"{libtpu_flags.RINGS_ENV}=0 (all-gathers and staged reduce-scatters under libtpu's 70% budget)")
    started = time.time()
    try:
        text = _trace_again(job, switch, os.path.join(workdir, "without_rings"), opts)
    except trace.TraceError as e:
        return {"switch": switch, "compiles": False, "fits": False, "error": str(e)}
    r = rep.check_program(text, spec, compiler, libtpu_flags.for_runtime(job.runtime, spec.chips, switch),
                          say=say)
    keep = ("compiles", "fits", "error", "does_not_fit", "memory", "collectives", "projection", "libtpu_flags",
            "compile_seconds")
    out = {k: r[k] for k in keep if k in r}
    out.update(switch=switch, traced_ring_ops=prog.ring_ops(text),
               trace_seconds=round(time.time() - started - r.get("compile_seconds", 0), 1))
    return out


def _trace_again(job, env: dict, folder: str, opts) -> str:
    """Trace the job again into `folder`, with `env` added to its environment; the step's module."""
    os.makedirs(folder, exist_ok=True)
    return trace.run_trace(dataclasses.replace(job, env=dict(job.env, **env)), folder, steps=opts.steps,
                           timeout=opts.timeout)


def _fit_again(result: dict, job, spec, compiler, flags: str, workdir: str, opts, say, calls) -> Optional[tuple]:
    """[Note: keep what fits] (xla_fsdp/memory/fit.py): a job with checkpoint_all_but_last="fit" found no device
    figures while it traced; its step is traced and compiled again given those of the program just compiled (every
    unit recomputed), and that step is reported, the first beside it. (its program, its report, its folder); None when
    the job does not use "fit" or its first program did not fit."""
    plan = _read_json(os.path.join(workdir, "fit.json"))
    if plan is None or plan.get("figures") is not None or not result.get("compiles") or not result.get("fits"):
        return None
    figures = {"peak": int(result["memory"]["peak"]), "limit": int(result["memory"]["usable"])}
    say(f"xla_fsdp.aot: checkpoint_all_but_last=\"fit\": {plan['units']} checkpointed units, every one "
        f"recomputed needs {figures['peak'] / 2 ** 30:.2f} GiB of {figures['limit'] / 2 ** 30:.2f}; tracing "
        "the step again with the units that fit keeping their activations")
    # the first program's optimized HLO and what libtpu freed compiling it go before the second trace, which needs
    # the host's memory too (a 128B step's compile held 16.6 GB of a 24 GB host)
    result.pop("optimized_hlo", None)
    result.pop("hbm_curve", None)
    gc.collect()
    release_freed_host_memory()
    again = os.path.join(workdir, "fit")
    report = os.path.join(again, "fit.json")
    env = {MEMORY_ENV: json.dumps(figures), environment.AOT: environment.with_aot(job.env, fit_report=report)}
    started = time.time()
    text = _trace_again(job, env, again, opts)
    traced_s = time.time() - started
    with open(report) as f:
        chosen = json.load(f)
    second = rep.check_program(text, spec, compiler, flags, say=say, calls=calls,
                               started_with=bool(result.get("start_up_flags")),
                               tensors=_read_json(os.path.join(again, TENSORS)),
                               keep_in=again, with_curve=bool(opts.timeline))
    second["trace_seconds"] = round(traced_s, 1)
    keep = ("memory", "projection", "compile_seconds", "trace_seconds")
    second["fit"] = {"count": chosen["count"], "units": chosen["units"], "saved_per_unit": chosen["saved"],
                     "saved_to_kept": chosen["saved_to_kept"], "headroom": chosen["headroom"],
                     "policies": chosen.get("policies"),
                     "every_unit_recomputed": {k: result[k] for k in keep if k in result}}
    split = result["memory"].get("breakdown") or {}
    if chosen["count"] == 0 and not chosen.get("policies") and "before_backward" in split and chosen["saved"]:
        # [Note: keep what fits, over time]: a hint, not what the job runs
        second["fit"]["last_unit_fits_over_time"] = fit.last_unit_fits_over_time(
            chosen["saved"][-1], split, figures["limit"])
    return text, second, again


def _drop_logs(logs: Optional[str]) -> None:
    """Remove this run's libtpu log directory and its name from the environment."""
    if logs:
        shutil.rmtree(logs, ignore_errors=True)
        if environment.raw(environment.TPU_LOG_DIR) == logs:
            del os.environ[environment.TPU_LOG_DIR]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, command = split_command(argv)
    opts = build_parser().parse_args(ours)
    say = (lambda *a: None) if opts.json else (lambda *a: print(*a, flush=True))
    try:
        spec, job = _job(opts, command)
    except (ValueError, ImportError, FileNotFoundError, trace.TraceError) as e:
        return _failed(e, EXIT_USAGE)
    logs = _libtpu_environment()
    try:
        compiler = _load_compiler()
    except ImportError as e:
        _drop_logs(logs)
        return _failed(e, EXIT_NO_LIBTPU)
    workdir = tempfile.mkdtemp(prefix="xla_fsdp_aot_")
    keep = False
    try:
        return _report(_trace_and_compile(job, spec, compiler, workdir, opts, say), opts)
    except trace.TraceError as e:
        keep = True  # the log it names
        return _failed(e, EXIT_TRACE)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        _drop_logs(logs)


def _failed(error: Exception, status: int) -> int:
    print(f"xla_fsdp.aot: {error}", file=sys.stderr)
    return status


def _job(opts, command):
    """The slice and the job to trace for it; a mistake in either raises before anything starts."""
    spec = topology.multislice(topology.parse_accelerator_type(opts.tpu), opts.num_slices, opts.dcn_gbps)
    job = trace.job_from_command(command, opts.runtime, spec.job_chips)
    if spec.slices > 1:  # the job splits its devices into slices as on the slices themselves
        job.env[environment.NUM_SLICES] = str(spec.slices)
    # [Note: one reduce-scatter per torus axis], 3-D (v4, v5p) and 2-D (v5e, v6e)
    job.torus = "x".join(map(str, spec.shape))
    if opts.dump:  # a URL whose file system or bucket is missing: now, not after the trace
        from xla_fsdp.checkpoint import storage

        storage.storage_for(opts.dump)
        storage.check_bucket(opts.dump)
    return spec, job


def _libtpu_environment() -> Optional[str]:
    """What libtpu's start-up reads, set for this host; this run's log directory to drop (None: the user's)."""
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                        ("TF_CPP_MIN_LOG_LEVEL", "2")):
        os.environ.setdefault(name, value)
    # libtpu's log, where it states the HBM the program needs ([Note: the HBM a TPU program needs]): in a
    # directory of this run's, unless the user named one
    logs = None if environment.raw(environment.TPU_LOG_DIR) is not None else tempfile.mkdtemp(
        prefix="xla_fsdp_aot_tpu_logs_")
    if logs:
        os.environ[environment.TPU_LOG_DIR] = logs
    return logs


def _trace_and_compile(job, spec, compiler, workdir: str, opts, say) -> dict:
    """Trace, compile, and check again where "fit" or the rings' switch asks; the report (TraceError: untraceable)."""
    say(f"xla_fsdp.aot: tracing {job.script} for {spec.name} ({spec.job_chips} chips, {spec.hosts * spec.slices} host(s)), "
        f"{job.runtime.replace('_', ' ')} runtime, on this host's CPU (nothing runs)")
    started = time.time()
    if "fit_report" not in environment.aot(job.env):  # [Note: keep what fits]
        job.env[environment.AOT] = environment.with_aot(job.env, fit_report=os.path.join(workdir, "fit.json"))
    text = trace.run_trace(job, workdir, steps=opts.steps, timeout=opts.timeout,
                           echo=None if (opts.quiet or opts.json) else (lambda l: print("  | " + l)))
    traced_s = time.time() - started
    own = opts.libtpu_flags is None and libtpu_flags.users_own()  # what libtpu read when it started
    flags = opts.libtpu_flags if opts.libtpu_flags is not None else \
        (own or libtpu_flags.for_runtime(job.runtime, spec.chips))
    calls = _read_json(os.path.join(workdir, "collective_sites.json"), [])
    result = rep.check_program(text, spec, compiler, flags, say=say, calls=calls, started_with=bool(own),
                               tensors=_read_json(os.path.join(workdir, TENSORS)), keep_in=workdir,
                               with_curve=bool(opts.timeline))
    # [Note: libtpu's compile and the host's malloc]: the allocator
    result.update(trace_seconds=round(traced_s, 1), allocator=allocator.in_use())
    text, result, traced_in = _fit_again(result, job, spec, compiler, flags, workdir, opts, say, calls) or \
        (text, result, workdir)
    recompute = _read_json(os.path.join(traced_in, RECOMPUTE))
    if recompute is not None:  # [Note: recomputation policies]: what the reported step's blocks saved
        result["recompute"] = recompute
    result.update(runtime=job.runtime, script=job.script)
    if _rings_to_retry(result, text, job, spec, opts):
        result["without_rings"] = _without_rings(job, spec, compiler, workdir, opts, say)
    if opts.dump:
        write_dump(opts.dump, traced_in, result.get("optimized_hlo"))
    if opts.timeline and result.get("compiles"):
        spans = step_page.write(opts.timeline, result, rep.render(result), result["optimized_hlo"], spec)
        say(f"xla_fsdp.aot: the step's picture, {spans} collective spans: {opts.timeline}")
    result.pop("optimized_hlo", None)
    result.pop("hbm_curve", None)
    return result


def _read_json(path: str, missing=None):
    """The JSON in `path` (what the traced process wrote: capture.TENSORS, ...), or `missing` without the file."""
    if not os.path.exists(path):
        return missing
    with open(path) as f:
        return json.load(f)


def _report(result: dict, opts) -> int:
    """Print the report (text or JSON); the exit status it gives."""
    print(json.dumps(result, indent=2) if opts.json else rep.render(result))
    if result.get("does_not_fit"):
        return EXIT_NO_FIT
    if not result["compiles"]:
        return EXIT_COMPILE
    return EXIT_OK if result["fits"] else EXIT_NO_FIT
