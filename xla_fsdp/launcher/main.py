"""`python launch/xla_spawn.py [--num_cores N] [--spmd | --per_chip] SCRIPT ARGS...`: the launcher's steps in order
(launch/xla_spawn.py's docstring says what each choice means)."""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from xla_fsdp.launcher.command_line import (ENTRY_POINT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError,
                                            build_parser, log, split_argv)
from xla_fsdp.launcher.plan import (async_collective_flags, detect_device, device_counts, make_plan,
                                    parse_num_cores, quiet_xla_logs, slice_chips)
from xla_fsdp.launcher.run_script import (ScriptEntry, defines_entry_point, describe_start, exit_code, run_as_main,
                                          run_in_process, run_self_starting, run_spawned)
from xla_fsdp.runtime import environment
from xla_fsdp.tpu import libtpu_flags
from xla_fsdp.launcher.single_controller import (choose_spmd, cpu_replicas, declares_single_controller,
                                                 per_chip_asked, refuse_single_controller_only)


def main(argv: Optional[list[str]] = None) -> int:
    """Launch as `python launch/xla_spawn.py *argv` (default: this process's arguments); returns the exit status: the
    script's, 1 when it failed, 2 for a usage error, 130 when interrupted."""
    own_process = argv is None  # `python launch/xla_spawn.py ...`, not a call from Python code
    argv = sys.argv[1:] if argv is None else argv
    quiet_xla_logs()
    parser = build_parser()
    launcher_argv, script, script_args = split_argv(argv)
    options = parser.parse_args(launcher_argv)
    if script is None:
        parser.error("the training script path is missing (e.g. launch/run_clm.py)")
    try:
        if not Path(script).is_file():
            raise UsageError(f"training script not found: {script} (working directory: {os.getcwd()})")
        device, source = detect_device(os.environ)
        if device == "TPU" and own_process:
            _start_with_faster_allocator()
        log(f"PJRT_DEVICE={device} ({source})")
        plan, spmd, num_cores, chips = _plan(options, script, device)
        _set_environment(plan, device, chips)
        return _run(script, script_args, plan, spmd, num_cores)
    except UsageError as exc:
        log(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        log("interrupted; all replicas stopped")
        return EXIT_INTERRUPTED


def _plan(options, script: str, device: str):
    """The runtime and the device count the flags, the environment and the script ask for, and what this device can run:
    (plan, single controller?, devices, the slice's chips or 0)."""
    spmd, why = choose_spmd(options, script, device, os.environ)
    counts = device_counts(device, spmd, os.environ)
    num_cores = parse_num_cores(options.num_cores, counts, spmd)
    if num_cores > 1 and not spmd and per_chip_asked(options, os.environ):
        refuse_single_controller_only(script, device)
    if device == "CPU" and num_cores > 1 and not spmd:
        spmd, why = cpu_replicas(options, script, num_cores, os.environ)
    if why:
        log(why)
    plan = make_plan(device, num_cores, spmd)
    if plan.reason:
        log(plan.reason)
    chips = slice_chips(counts.default) if device == "TPU" and spmd else 0
    return plan, spmd, num_cores, chips


def _set_environment(plan, device: str, chips: int) -> None:
    """The environment the script (and its replicas) start in: the plan's variables, libtpu's flags on a TPU (their
    budget depends on the slice: [Note: rings by default on a TPU]), and this host's folder of the compile cache under
    the single controller (replicas choose their own)."""
    os.environ.update(plan.env)
    if device == "TPU":
        if chips and not libtpu_flags.chips_of(os.environ):
            os.environ[libtpu_flags.CHIPS_ENV] = environment.with_internal(os.environ, chips=chips)
        async_collective_flags()
    if not plan.spawn:
        from xla_fsdp.runtime import compile_cache

        try:
            cache = compile_cache.from_environment(f"host-{compile_cache.host_index()}")
        except compile_cache.CompileCacheError as e:
            raise UsageError(str(e)) from None
        if cache:
            log(f"{compile_cache.ENV}: compiled programs kept in {cache}")


def _run(script: str, script_args, plan, spmd: bool, num_cores: int) -> int:
    """Run the script as it is written: a self-starting script's own start, a plain script once as __main__ under the
    single controller, else its entry point in this process or spawned."""
    from xla_fsdp.runtime.choice import enter_single_controller
    from xla_fsdp.runtime.self_starting import entry_calls

    calls = entry_calls(script)
    if spmd:
        enter_single_controller()
    if calls:
        log(describe_start(script, calls, plan))
        return run_self_starting(script, tuple(script_args), plan)
    entry = ScriptEntry(script, tuple(script_args))
    if not plan.spawn and not defines_entry_point(script) and (spmd or declares_single_controller(script)):
        if not spmd:  # one device, as the script's own process group would set it up
            enter_single_controller()
        log(f"{script} defines no {ENTRY_POINT}(index): it runs once as __main__ (single controller)")
        return run_as_main(entry)
    try:
        fn = entry.load()  # also checks _mp_fn early, before any spawn
    except UsageError:
        raise
    except SystemExit as exc:
        return exit_code(exc)
    except Exception:
        log(f"importing {script} failed:\n{traceback.format_exc()}")
        return EXIT_FAILED
    if plan.spawn:
        log(f"spawning {num_cores} replicas (one process per chip)")
        return run_spawned(entry)
    return run_in_process(fn)


def _start_with_faster_allocator() -> None:
    """[Note: libtpu's compile and the host's malloc] (xla_fsdp/runtime/allocator.py): on a TPU the job's first step is
    a libtpu compile, faster with jemalloc (docs/scan.md). Start this command again with one preloaded when the host has
    one (the replicas inherit it); returns when there is none, it is chosen already, or the malloc variable says
    `system`."""
    from xla_fsdp.runtime import allocator

    try:
        allocator.restart_with([sys.executable, *sys.argv])
    except allocator.AllocatorError as e:
        raise UsageError(str(e)) from None
    if allocator.started_with():
        log(f"allocator: {allocator.in_use()} preloaded for libtpu's compile "
            f"({allocator.ENV}=system keeps glibc's malloc)")
