"""Running the script once the plan is made: its `_mp_fn(index)` (imported by path, here or in one spawned process
per chip), its own `__main__` with its xmp.spawn / torch_xla.launch routed to the plan
(xla_fsdp.runtime.self_starting), or, on the single controller, a plain script as `python script.py` runs it. A
replica's failure is a traceback and exit 1."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import multiprocessing
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

from xla_fsdp.launcher.command_line import ENTRY_POINT, EXIT_FAILED, RUNTIME_ENV, SINGLE_CONTROLLER, UsageError, log
from xla_fsdp.launcher.plan import LaunchPlan


@dataclasses.dataclass(frozen=True)
class ScriptEntry:
    """The script's ``_mp_fn``, loadable in this process or in a spawned replica.

    Picklable (paths and strings only), so spawned replicas import the script themselves instead of receiving a function
    object."""

    script: str
    args: tuple[str, ...]

    def load(self) -> Callable[[int], object]:
        path = Path(self.script)
        _as_python_would(self.script, self.args)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        # Registered under its own name so objects the script pickles (e.g. for DataLoader workers) can be found again.
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        fn = getattr(module, ENTRY_POINT, None)
        if not callable(fn):
            raise UsageError(f"{self.script} defines no function {ENTRY_POINT}(index); add `def {ENTRY_POINT}(index): "
                             f"main()` to it, or start the script itself under `if __name__ == \"__main__\":` with "
                             "xmp.spawn(fn, args=...)")
        try:
            inspect.signature(fn).bind(0)
        except TypeError as e:
            from xla_fsdp.runtime.self_starting import describe

            raise UsageError(
                f"{self.script}: xla_spawn calls {ENTRY_POINT}(index), the replica index alone, because the "
                f"script does not start itself (no xmp.spawn or torch_xla.launch call), but "
                f"{describe(fn)} cannot be called so ({e}). Give its other parameters defaults, or end "
                f"the script with `if __name__ == \"__main__\": xmp.spawn({ENTRY_POINT}, args=(...))`, "
                "which xla_spawn then runs with the script's own arguments") from None
        except ValueError:
            pass  # no signature to read: the call will say
        return fn

    def __call__(self, index: int) -> None:
        """Replica body in the spawn path (run_spawned wraps it in ReplicaCall)."""
        self.load()(index)


def defines_entry_point(script: str) -> bool:
    """Whether `script` defines ``_mp_fn`` at module level (read, not imported)."""
    import ast

    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), filename=script)
    except (OSError, SyntaxError, ValueError):
        return True  # importing it will say what is wrong
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == ENTRY_POINT:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == ENTRY_POINT for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" or (a.asname or a.name.split(".")[0]) == ENTRY_POINT for a in node.names):
                return True
    return False


def _as_python_would(script: str, args) -> None:
    """`sys.argv` and `sys.path` as `python script.py args...` sets them: the script's folder first, so its sibling
    modules import."""
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))


def _exit_status(call: Callable[[], object], what: str) -> int:
    """Run `call()`: 0, a SystemExit's status (`exit_code`), or 1 after `what failed:` and the traceback.
    KeyboardInterrupt is left to main(), which owns the exit-130 path."""
    try:
        call()
    except SystemExit as exc:
        return exit_code(exc)
    except Exception:
        log(f"{what} failed:\n{traceback.format_exc()}")
        return EXIT_FAILED
    return 0


def run_as_main(entry: "ScriptEntry") -> int:
    """Run the script as ``python script.py args...`` would, here (the single controller)."""
    _as_python_would(entry.script, entry.args)
    return _exit_status(lambda: runpy.run_path(entry.script, run_name="__main__"), entry.script)


def run_in_process(fn: Callable[[int], object]) -> int:
    """Call ``fn(0)`` here; a failure becomes a traceback and exit 1."""
    return _exit_status(lambda: fn(0), "replica 0")


def exit_code(exc: SystemExit) -> int:
    """The process exit status `sys.exit(exc.code)` would give; its message (a code that is not an int:
    `sys.exit("--block_size ...")`, a user's mistake the job named) is printed to stderr as Python prints it, so the
    launcher never swallows what the job said."""
    from xla_fsdp.runtime.self_starting import exit_status

    if exc.code is not None and not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr, flush=True)
    return exit_status(exc)


def run_spawned(entry: Callable, args: tuple = (), spawn: Optional[Callable] = None,
                start_method: str = "spawn") -> int:
    """One process per chip through torch_xla's spawn (`spawn`: its original, when a self-starting script's calls are
    routed); `entry(index, *args)` is each replica's body (picklable). A message the replicas exit with is printed once,
    naming the replicas.

    SIGINT stops the replicas. SIGTERM (a spot VM's preemption, a maintenance event) is passed on to them and waited
    for: a job that saves on it (run_clm, `xla_fsdp.checkpoint.Preemption`) saves at the end of its step and exits
    EXIT_PREEMPTED, and so does the launcher."""
    import tempfile

    from xla_fsdp.runtime.self_starting import EXIT_PREEMPTED, ReplicaCall, preempted_replicas, replica_messages

    if spawn is None:
        import torch_xla.distributed.xla_multiprocessing as xmp

        spawn = xmp.spawn

    def stop_replicas(signum, frame):
        # Replicas may not have seen the signal (e.g. `kill -INT <launcher>`); terminate them so the pool's shutdown
        # cannot wait on them forever.
        for child in multiprocessing.active_children():
            child.terminate()
        raise KeyboardInterrupt

    forwarded = []

    def pass_on(signum, frame):
        replicas = multiprocessing.active_children()
        for child in replicas:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)
        if not forwarded:
            log(f"{signal.Signals(signum).name} passed on to the {len(replicas)} replica processes; waiting for them "
                "(a job that saves on it saves at the end of its step)")
        forwarded.append(signum)

    signal.signal(signal.SIGINT, stop_replicas)
    signal.signal(signal.SIGTERM, pass_on)
    with tempfile.TemporaryDirectory(prefix="xla_spawn-") as messages:
        try:
            spawn(ReplicaCall(entry, args, messages), args=(), nprocs=None, start_method=start_method)
        except Exception as exc:  # BrokenProcessPool and anything re-raised by the pool
            said = replica_messages(messages)
            if forwarded and not said:
                log("the replicas ended on the SIGTERM passed on to them without saving (the script does not "
                    "catch it: xla_fsdp.checkpoint.Preemption makes it a checkpoint)")
                return 128 + signal.SIGTERM
            for message, replicas in said.items():
                print(message, file=sys.stderr, flush=True)
                log(f"replica{'s' if len(replicas) > 1 else ''} {', '.join(map(str, replicas))} exited with "
                    "the message above; the other replicas were stopped")
            if not said:
                log(f"a replica failed ({type(exc).__name__}); its message is above. The other replicas were stopped.")
            return EXIT_FAILED
        preempted = preempted_replicas(messages)
    if preempted:
        log(f"replica{'s' if len(preempted) > 1 else ''} {', '.join(map(str, preempted))} saved the checkpoint the "
            f"signal asked for; exit status {EXIT_PREEMPTED}: the same command resumes from it")
        return EXIT_PREEMPTED
    return 0


def run_self_starting(script: str, args: tuple[str, ...], plan: LaunchPlan) -> int:
    """Run `script` as `python script.py args` would, its xmp.spawn / torch_xla.launch routed to `plan`: torch_xla's own
    spawn, one process per chip (plan.spawn), else `fn(0, *args)` here. torch_xla's `nprocs=1` path also calls
    `fn(0, *args)` in the calling process."""
    from xla_fsdp.runtime import self_starting

    original = []  # torch_xla's own spawn, set when the hooks are in
    started: list[str] = []  # the entry points the script called, so a failure names replica 0

    def start(caller, fn, fn_args, nprocs, start_method):
        self_starting.nprocs_asked(caller, nprocs, plan.num_cores)
        self_starting.check_callable(fn, fn_args, caller)
        started.append(caller)
        if plan.spawn:
            log(f"{caller}: spawning {plan.num_cores} replicas of {self_starting.describe(fn)} (one process per chip)")
            code = run_spawned(fn, fn_args, spawn=original[0], start_method=start_method)
            if code:
                raise SystemExit(code)
            return None
        return fn(0, *fn_args)

    _as_python_would(script, args)
    try:
        with self_starting.hooked_entry_points(start) as spawn:
            original.append(spawn)
            runpy.run_path(script, run_name="__main__")
    except self_starting.Refused as e:
        raise UsageError(f"{script}: {e}") from None
    except SystemExit as exc:
        return exit_code(exc)
    except Exception:
        what = "replica 0" if started and not plan.spawn else script
        log(f"{what} failed:\n{traceback.format_exc()}")
        return EXIT_FAILED
    return 0


def describe_start(script: str, calls: tuple[str, ...], plan: LaunchPlan) -> str:
    """The one line that says how a self-starting script's own entry point will run."""
    if plan.spawn:
        how = f"one process per chip ({plan.num_cores}), each calling fn(index, *args), world {plan.num_cores}"
    elif plan.env.get(RUNTIME_ENV) == SINGLE_CONTROLLER:
        how = "fn(0, *args) once, in this process (the single controller)"
    else:
        how = "fn(0, *args) in this process on one device, world 1 (torch_xla's nprocs=1)"
    return (f"{script} starts itself: running its __main__ with its own arguments; its "
            f"{' or '.join(sorted(calls, reverse=True))}(fn, args=...) runs {how}")
