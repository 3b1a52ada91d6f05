"""The host's memory allocator for processes that compile with libtpu.

[Note: libtpu's compile and the host's malloc] libtpu's compiler allocates and frees small objects at a great rate from
two or more threads: under glibc's malloc a large share of the compile's CPU time is in the allocator and the compile
threads keep each other waiting. With jemalloc or tcmalloc preloaded the same program compiles in 0.82x the time
(docs/scan.md). TPU VM users commonly preload tcmalloc for the same reason.

`preload_environment` says what to add to a process's environment so that it starts with a faster allocator: the first
of jemalloc and tcmalloc this host has (the system's packages, `apt install libjemalloc2` or `libtcmalloc-minimal4`),
unless the process already preloads something or the malloc variable (`environment.MALLOC`) says otherwise: `system`
keeps glibc's, a path names the library. A process can only change its allocator by starting again, so `restart_with`
execs the same command with the library preloaded; the mark in the environment keeps it from doing so twice.
`python -m xla_fsdp.aot` starts so (its traced child inherits the preload), and so does the launcher on a TPU
(`launch/xla_spawn.py`; the replicas inherit it). Nothing changes what the program computes: the allocator only hands
out memory."""
from __future__ import annotations

import ctypes.util
import os
import sys
from typing import Dict, List, Mapping, Optional

from xla_fsdp.runtime import environment

ENV = environment.MALLOC  # unset or "auto": the first of CANDIDATES found; "system": glibc's; else a path
MARK = environment.INTERNAL  # its "malloc", set by restart_with: this process already chose
CANDIDATES = ("jemalloc", "tcmalloc_minimal", "tcmalloc")  # names as ctypes.util.find_library takes them
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class AllocatorError(ValueError):
    """The malloc variable names something that is not a loadable library."""


def find_library(name: str) -> Optional[str]:
    """The path of lib<name>.so.* on this host, or None."""
    found = ctypes.util.find_library(name)  # a soname such as libtcmalloc_minimal.so.4, or None
    for folder in _DIRS:
        for candidate in ([found] if found else []) + [f"lib{name}.so"]:
            path = os.path.join(folder, candidate)
            if os.path.exists(path):
                return path
    return None


def choose(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The library to preload, or None: glibc's malloc stays (asked for, nothing found, or the process preloads
    something already)."""
    wanted = environment.get(ENV, environ) or "auto"
    if wanted == "system" or started_with(environ):
        return None
    if wanted != "auto":
        if not os.path.isfile(wanted):
            raise AllocatorError(f"{ENV}={wanted}: no such file. Name a malloc library (e.g. "
                                 "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2), or set it to "
                                 "'auto' (the first of jemalloc and tcmalloc found) or 'system' (glibc's malloc)")
        return wanted
    if environment.get(environment.LD_PRELOAD, environ):
        return None  # the user's own preload: theirs to choose
    return next((path for path in map(find_library, CANDIDATES) if path), None)


def preload_environment(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The variables to add to a process's environment for the allocator `choose` picks ({} for none)."""
    path = choose(environ)
    if path is None:
        return {}
    preload = " ".join(p for p in (environment.get(environment.LD_PRELOAD, environ), path) if p)
    return {environment.LD_PRELOAD: preload, MARK: environment.with_internal(environ, malloc=os.path.basename(path))}


def started_with(environ: Mapping[str, str] = os.environ) -> str:
    """The malloc library the launcher restarted this process with ("" when it did not)."""
    return environment.internal(environ).get("malloc", "")


def in_use(environ: Mapping[str, str] = os.environ) -> str:
    """What this process allocates with, as reports say it: the library's file name or "glibc"."""
    return (started_with(environ) or os.path.basename(environment.get(environment.LD_PRELOAD, environ).split(" ")[-1])
            or "glibc")


def restart_with(argv: List[str], environ: Mapping[str, str] = os.environ) -> None:
    """Exec `argv` (a command for this Python: [sys.executable, ...]) again with a faster allocator when one is to be
    had; returns only when there is none (or it was chosen already)."""
    extra = preload_environment(environ)
    if not extra:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, {**environ, **extra})


if __name__ == "__main__":  # `python xla_fsdp/runtime/allocator.py`: the variables as `env` takes them (Makefile)
    try:
        print(" ".join(f"{name}={value}" for name, value in preload_environment().items()))
    except AllocatorError as e:
        sys.exit(f"error: {e}")
