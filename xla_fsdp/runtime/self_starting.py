"""Scripts that start themselves, run by the launcher in the runtime it chose.

torch_xla's own training scripts end with

    if __name__ == "__main__":
        xmp.spawn(_mp_fn, args=(FLAGS,))      # or torch_xla.launch(_mp_fn, args=(FLAGS,))

and their `_mp_fn(index, flags)` takes more than the index that `launch/xla_spawn.py` passes to the `_mp_fn(index)` of
Hugging Face's convention. For such a script the launcher runs the script's own `__main__` (its own argument parsing,
its own entry point) and routes its call to `xmp.spawn` / `torch_xla.launch` to the runtime the launcher chose
(`hooked_entry_points`): one process per chip through torch_xla's own spawn, or `fn(0, *args)` in this process (one
device, or the single controller). Which scripts start themselves is read from the syntax tree (`entry_calls`), before
anything runs. torch_xla is imported only by the routing, never by the detection."""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import reprlib
import sys
import traceback
from typing import Callable, Dict, Iterator, Optional, Tuple

from .choice import parse_script

# the calls that start a torch_xla script, by their full dotted name -> how users write them
ENTRY_POINTS: Dict[str, str] = {
    "torch_xla.distributed.xla_multiprocessing.spawn": "xmp.spawn",
    "torch_xla.launch": "torch_xla.launch",
    "torch_xla.torch_xla.launch": "torch_xla.launch",
}
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# a job that saved a checkpoint when a signal asked it to (EX_TEMPFAIL of sysexits.h: "try again"):
# [Note: a signal becomes a checkpoint] in xla_fsdp/checkpoint/preemption.py
EXIT_PREEMPTED = 75
PREEMPTED_MARK = "preempted-"


class Refused(Exception):
    """The script's call cannot run as asked; the message says why and what works (exit 2)."""


def entry_calls(script: str) -> Tuple[str, ...]:
    """The torch_xla entry points `script` calls anywhere ("xmp.spawn", "torch_xla.launch"), read from its syntax tree
    through its import aliases; () when it calls none (or does not parse: running it will say what is wrong)."""
    try:
        tree = parse_script(script)
    except (OSError, SyntaxError, ValueError):
        return ()
    aliases: Dict[str, str] = {}  # local name -> the dotted name it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:  # `import torch_xla.distributed.xla_multiprocessing` binds `torch_xla`
                top = a.name.split(".")[0]
                aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    names = (_dotted(node.func, aliases) for node in ast.walk(tree) if isinstance(node, ast.Call))
    return tuple(dict.fromkeys(ENTRY_POINTS[name] for name in names if name in ENTRY_POINTS))


def _dotted(node: ast.AST, aliases: Dict[str, str]) -> Optional[str]:
    """The dotted name of a call's function, its first part resolved through the script's import `aliases`."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)]) if isinstance(node, ast.Name) else None


def describe(fn: Callable) -> str:
    """`name(signature)` of `fn`, with where it is defined when Python knows."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(...)"
    code = getattr(fn, "__code__", None)
    where = f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
    return f"{name}{signature}{where}"


def check_callable(fn: Callable, args: tuple, caller: str) -> None:
    """Refuse, by name, an `fn` that cannot take what torch_xla's entry points pass it: the replica index, then
    `args`."""
    if not callable(fn):
        raise Refused(f"{caller}() was given {fn!r}, which is not a function; pass the function each "
                      "replica runs, e.g. xmp.spawn(_mp_fn, args=(flags,))")
    try:
        inspect.signature(fn).bind(0, *args)
    except TypeError as e:
        name = getattr(fn, "__name__", "fn")
        passed = ", ".join(["0"] + [reprlib.repr(a) for a in args])
        raise Refused(
            f"{caller}() starts {describe(fn)}, which cannot take what it is called with: the replica "
            f"index, then args={reprlib.repr(tuple(args))}, i.e. {name}({passed}) ({e}). "
            f"xmp.spawn and torch_xla.launch call fn(index, *args): make the index {name}'s first "
            f"parameter (def {name}(index, ...)) and pass the rest in args=") from None
    except ValueError:
        pass  # no signature to read (a builtin): the call itself will say


def nprocs_asked(caller: str, nprocs: Optional[int], num_cores: int) -> None:
    """torch_xla's `nprocs` against the launcher's --num_cores: None takes the launcher's count, 1 must agree with it;
    torch_xla accepts nothing else."""
    if nprocs is None:
        return
    if nprocs != 1:
        raise Refused(f"{caller}(nprocs={nprocs!r}): torch_xla accepts nprocs=1 or None (every device); "
                      "drop nprocs= and choose the count with xla_spawn's --num_cores")
    if num_cores != 1:
        raise Refused(f"{caller} asks for one replica (nprocs=1 or debug_single_process=True) but xla_spawn "
                      f"was given --num_cores {num_cores}; run with --num_cores 1, or drop the argument")


class ReplicaCall:
    """`fn(index, *args)` in a replica process; any failure ends that process at once.

    Picklable when `fn` is (a module-level function of the script), so torch_xla's spawn can send it to each replica.
    Exiting with os._exit breaks the parent's process pool, which then terminates the other replicas instead of leaving
    them blocked in a collective this replica will never join. A `sys.exit("message")` is written to
    `messages/replica-<index>` when the launcher gave a folder, so the launcher prints each message once for all
    replicas (`replica_messages`); else to stderr. A replica that exits EXIT_PREEMPTED (it saved the checkpoint a
    SIGTERM asked for) returns instead, leaving `messages/preempted-<index>`: the first to leave must not break the pool
    while the others still write their part (`preempted_replicas`)."""

    def __init__(self, fn: Callable, args: tuple, messages: Optional[str] = None):
        self.fn, self.args, self.messages = fn, tuple(args), messages

    def __setstate__(self, state: dict) -> None:
        # unpickled on the replica process's main thread, before torch_xla runs `fn` on a thread of it
        self.__dict__.update(state)
        from .signals import listen_on_main_thread

        listen_on_main_thread()  # [Note: a replica's signals]

    def __call__(self, index: int) -> None:
        try:
            from .compile_cache import from_environment

            from_environment(f"rank-{index}")  # each replica its own folder of the compile cache
            self.fn(index, *self.args)
        except SystemExit as exc:
            code = exit_status(exc)
            if code == EXIT_PREEMPTED and self.messages is not None:
                open(os.path.join(self.messages, f"{PREEMPTED_MARK}{index}"), "w").close()
                return
            if code != 0:
                if isinstance(exc.code, int):
                    print(f"xla_spawn: replica {index} exited with {exc.code}", file=sys.stderr, flush=True)
                else:
                    self._say(index, str(exc.code))
                os._exit(code)
        except KeyboardInterrupt:
            os._exit(EXIT_INTERRUPTED)
        except BaseException:
            print(f"xla_spawn: replica {index} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(EXIT_FAILED)

    def _say(self, index: int, message: str) -> None:
        if self.messages is None:
            print(message, file=sys.stderr, flush=True)
            return
        path = os.path.join(self.messages, f"replica-{index}")
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.write(message)
        os.replace(path + ".part", path)  # whole or absent: the pool may stop this process next


def exit_status(exc: SystemExit) -> int:
    """The status `sys.exit(exc.code)` ends a process with: the int, 0 for None, else 1 (Python then prints the code,
    the script's message, to stderr)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else EXIT_FAILED


def preempted_replicas(folder: str) -> list:
    """The replicas that saved after a signal and returned ([ReplicaCall]), in order."""
    return sorted(int(n[len(PREEMPTED_MARK):]) for n in os.listdir(folder) if n.startswith(PREEMPTED_MARK))


def replica_messages(folder: str) -> Dict[str, list]:
    """What the replicas' `sys.exit("message")` said ([ReplicaCall]): message -> replica indices."""
    said: Dict[str, list] = {}
    for name in sorted(os.listdir(folder), key=lambda n: (len(n), n)):
        if name.startswith("replica-") and not name.endswith(".part"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                said.setdefault(f.read(), []).append(int(name[len("replica-"):]))
    return said


# start(caller, fn, args, nprocs, start_method) runs the replicas as the launcher decided
StartFn = Callable[[str, Callable, tuple, Optional[int], str], object]


@contextlib.contextmanager
def hooked_entry_points(start: StartFn) -> Iterator[Callable]:
    """While the script runs, its `xmp.spawn(...)` and `torch_xla.launch(...)` call `start`.

    Yields torch_xla's own spawn (for the one-process-per-chip route). The module attributes are swapped, not wrapped,
    so `from ... import spawn` inside the script binds the routed function too; they are restored afterwards."""
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.torch_xla as txla

    def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
        return start("xmp.spawn", fn, tuple(args), nprocs, start_method)

    def launch(fn, args=(), start_method="spawn", debug_single_process=False):
        return start("torch_xla.launch", fn, tuple(args), 1 if debug_single_process else None, start_method)

    saved = [(xmp, "spawn", xmp.spawn), (torch_xla, "launch", torch_xla.launch), (txla, "launch", txla.launch)]
    original_spawn = xmp.spawn
    xmp.spawn, torch_xla.launch, txla.launch = spawn, launch, launch
    try:
        yield original_spawn
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
