"""A warm interpreter that forks the suite's Python processes ([Note: warm interpreters]).

Started once per pytest session (tests/warm/__init__.py). It imports torch and
the torch modules torch_xla pulls in at import (dynamo, functorch, inductor:
~7 s of CPU on this host, paid by every fresh interpreter), then serves the
shim (tests/warm/shim.py): for each request it forks a child that takes the
shim's file descriptors, environment, working directory and arguments, and
runs the script, `-m` module or `-c` code as `python` would. torch_xla,
xla_fsdp, jax and libtpu are imported by the child, after its environment is
in place, exactly as in a fresh process.

Protocol on the Unix socket, one connection per process: the shim sends one
JSON message with SCM_RIGHTS descriptors; the zygote answers "pid N\n" (or
"fallback\n": the shim then execs the real interpreter), and later
"exit N\n" or "signal N\n". If the shim's connection closes first (the shim
was killed), the child is killed with SIGKILL.
"""
from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys

# what a fresh interpreter with no PYTHONPATH puts after sys.path[0]
BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
# variables the interpreter (PYTHONHASHSEED, PYTHONMALLOC, ...) or the preloaded libraries (torch,
# OpenMP/BLAS, transformers and the hub, the dynamic loader, the locale) read at start: a request whose
# values differ from the zygote's gets a real interpreter, except the few a child applies itself (HANDLED)
READ_AT_START = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "HF_", "HUGGINGFACE_",
                 "TRANSFORMERS_", "TOKENIZERS_", "LD_", "LANG", "LC_", "TZ", "PYTHON")
START_ENV = {k: v for k, v in os.environ.items() if k.startswith(READ_AT_START)}
HANDLED = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER")
PRELOAD = ("torch", "torch._dynamo", "functorch.compile", "torch._inductor.lowering",
           "torch._inductor.fx_passes.post_grad", "transformers")


def parse(argv: list):
    """python's command line -> (flags, kind, target, args), or None where a fresh interpreter is needed."""
    flags = {"B": False, "u": False, "E": False, "s": False, "W": [], "X": []}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-c", "-m"):
            if i + 1 >= len(argv):
                return None
            return flags, a[1], argv[i + 1], argv[i + 2:]
        if a in ("-W", "-X"):
            if i + 1 >= len(argv):
                return None
            flags[a[1]].append(argv[i + 1])
            i += 2
            continue
        if a.startswith("-") and len(a) > 1 and not a.startswith("--") and all(ch in "BuEs" for ch in a[1:]):
            for ch in a[1:]:
                flags[ch] = True
            i += 1
            continue
        if a.startswith("-"):
            return None  # -i, -O, -I, -S, -x, '-', --help, ...: a real interpreter
        return flags, "script", a, argv[i + 1:]
    return None  # the interactive prompt


def acceptable(flags, env: dict) -> bool:
    if flags["X"]:
        return False
    theirs = {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in HANDLED}
    ours = {k: v for k, v in START_ENV.items() if k not in HANDLED}
    return theirs == ours


def _recv(conn: socket.socket):
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(64 * array.array("i").itemsize))
        if not msg:
            raise ConnectionError("shim closed the connection")
        data += msg
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(blob[:len(blob) - len(blob) % got.itemsize])
                fds.extend(got)
    return json.loads(data), fds


def _become(request: dict, fds: list, shim: str, parsed):
    """In the forked child: take the shim's descriptors, environment and arguments, and run."""
    flags, kind, target, args = parsed
    # the shim's descriptors at their numbers; nothing of the zygote's stays open
    high = [fcntl_dup_high(fd) for fd in fds]
    keep = set()
    for fd_number, fd in zip(request["fds"], high):
        os.dup2(fd, fd_number, inheritable=True)
        keep.add(fd_number)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    import io

    unbuffered = flags["u"] or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8") \
        if 0 in keep else None
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        if fd not in keep:
            setattr(sys, name, None)
            continue
        raw = io.FileIO(fd, "w", closefd=False)
        tty = os.isatty(fd)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                                  line_buffering=tty or fd == 2, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, "__%s__" % name, stream)
    sys.__stdin__ = sys.stdin
    sys.dont_write_bytecode = flags["B"] or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    import warnings

    # the zygote's filters are a fresh interpreter's after importing torch; the child's own options go on top
    for spec in ([] if flags["E"] else [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]) + flags["W"]:
        try:
            warnings._setoption(spec)
        except warnings._OptionError as e:
            print("Invalid -W option ignored:", e, file=sys.stderr)
    if env.get("PYTHONFAULTHANDLER") and not flags["E"]:
        import faulthandler

        faulthandler.enable()
    extra = [] if flags["E"] else [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = {"script": os.path.dirname(os.path.realpath(target)), "m": os.getcwd(), "c": ""}[kind]
    sys.path[:] = [first] + extra + BASE_PATH
    import importlib

    importlib.invalidate_caches()
    sys.executable = shim
    import multiprocessing.spawn

    multiprocessing.spawn.set_executable(shim)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in request.get("ignored", []):  # ignored signals stay ignored across exec
        signal.signal(sig, signal.SIG_IGN)
    # a fresh interpreter's generators are seeded from the OS, each its own
    import torch

    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    import multiprocessing.process

    multiprocessing.process.ORIGINAL_DIR = os.getcwd()

    import types

    # a fresh __main__ (runpy runs `-m` modules in __main__'s namespace: not the zygote's)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if kind == "m":
        import runpy

        sys.argv = [target] + args
        return lambda: runpy._run_module_as_main(target, alter_argv=True)
    if kind == "c":
        sys.argv = ["-c"] + args
        code = compile(target, "<string>", "exec")
    else:
        sys.argv = [target] + args
        path = os.path.abspath(target)
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as e:
            print(f"{request['argv0']}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(2)
        main.__file__ = path
        main.__cached__ = None
        code = compile(source, path, "exec")
    return lambda: exec(code, main.__dict__)


def _die_with_parent():
    """A child of a zygote that dies (its suite gone) is killed rather than left running."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def fcntl_dup_high(fd: int) -> int:
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000)
    os.close(fd)
    return high


def serve(path: str, shim: str):
    """Accept requests until the suite (our stdin's writer) goes away; returns a callable in a child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the suite's, not ours
    print("ready", flush=True)
    children = {}  # pid -> connection
    by_conn = {}  # connection -> pid
    while True:
        ready, _, _ = select.select([listener, sys.stdin] + list(by_conn), [], [], 0.05)
        for conn in ready:
            if conn is sys.stdin:
                if not os.read(0, 4096):
                    for pid in children:
                        _kill(pid)
                    return None
            elif conn is listener:
                client, _ = listener.accept()
                try:
                    request, fds = _recv(client)
                except (ConnectionError, ValueError):
                    client.close()
                    continue
                parsed = parse(request["argv"])
                if parsed is None or not acceptable(parsed[0], request["env"]):
                    _refuse(client, fds)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError:
                    _refuse(client, fds)
                    continue
                if pid == 0:
                    _die_with_parent()
                    listener.close()
                    for c in list(by_conn) + [client]:
                        c.close()
                    return _become(request, fds, shim, parsed)
                for fd in fds:
                    os.close(fd)
                try:
                    client.sendall(b"pid %d\n" % pid)
                except OSError:  # the shim is gone already
                    _kill(pid)
                children[pid] = client
                by_conn[client] = pid
            else:  # a shim's connection closed before its child ended: the shim was killed
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone:
                    _kill(by_conn.pop(conn))
                    conn.close()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            if by_conn.pop(conn, None) is None:  # its shim is gone
                continue
            msg = b"signal %d\n" % os.WTERMSIG(status) if os.WIFSIGNALED(status) \
                else b"exit %d\n" % os.WEXITSTATUS(status)
            try:
                conn.sendall(msg)
            except OSError:
                pass
            conn.close()


def _refuse(client: socket.socket, fds: list):
    """This request gets a real interpreter (the shim execs it)."""
    client.sendall(b"fallback\n")
    client.close()
    for fd in fds:
        os.close(fd)


def _kill(pid: int):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main():
    path, shim = sys.argv[1:3]
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    run = serve(path, shim)
    if run is None:
        return 0
    # the child: run the program as __main__ would, then end as python does
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _finish(1, signal.SIGINT)  # python ends by SIGINT on an uncaught KeyboardInterrupt
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _finish(code: int, sig=None):
    """Python's shutdown up to the module teardown: wait for threads, run atexit, drop the program's
    globals (their files flush and close), flush stdio; then leave without freeing torch's modules
    one by one (seconds of CPU; a fresh interpreter exiting only frees its process)."""
    import atexit
    import os
    import signal
    import sys
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    main_module = sys.modules.get("__main__")
    if main_module is not None:
        main_module.__dict__.clear()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    sys.exit(main())
