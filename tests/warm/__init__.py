"""Warm interpreters for the suite's child processes.

[Note: warm interpreters]
Most of this suite runs in child processes (workers at several device counts,
virtual hosts, launchers, the AOT check's tracer), and every fresh interpreter
spends ~7 s of CPU importing torch and the torch modules torch_xla imports
(dynamo, functorch, inductor) before any of our code runs: on this 2-core host
that was about half the suite's time. `start()` runs zygotes
(tests/warm/zygote.py) that has imported them, and points `sys.executable` and
multiprocessing's executable at a shim (tests/warm/shim.py) that has the
zygote fork each child with the shim's descriptors, environment, directory and
command line. torch_xla, xla_fsdp, jax and libtpu are still imported fresh in
every child, after its environment is set, so what depends on the environment
at import (PJRT_DEVICE, XLA_USE_SPMD, XLA_FLAGS, LIBTPU_INIT_ARGS) sees the
child's own. Python's string-hash seed is fixed when an interpreter starts, so
there are two zygotes, used in turn (each with its own seed). Command lines a forked child cannot honour (-X, -O, -I, -S,
PYTHONHASHSEED, ...) get the real interpreter. XLA_FSDP_TEST_WARM=0 turns
this off: every child is a fresh interpreter, as before.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# two zygotes, taken in turn: each has its own string-hash seed, as two fresh interpreters would, so
# the ranks of one job do not share one (a set of strings iterated in a different order on each rank
# is a bug the suite must still be able to see)
ZYGOTES = 2


def start(tmp: str):
    """Start the zygotes and switch this process's children to the shim; returns them (or None)."""
    if os.environ.get("XLA_FSDP_TEST_WARM", "1") == "0":
        return None
    real = sys.executable  # the venv's own path: its site-packages come with it
    shim = os.path.join(tmp, "python")
    with open(os.path.join(HERE, "shim.py")) as f:
        body = f.read()
    with open(shim, "w") as f:
        f.write(f"#!{real} -SE\n" + body)
    os.chmod(shim, os.stat(shim).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    socks, zygotes = [], []
    for i in range(ZYGOTES):
        socks.append(os.path.join(tmp, f"zygote{i}.sock"))
        zygotes.append(subprocess.Popen([real, os.path.join(HERE, "zygote.py"), socks[-1], shim],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        start_new_session=True))
    for zygote in zygotes:
        line = zygote.stdout.readline()
        if line.strip() != "ready":
            for z in zygotes:
                z.kill()
            raise RuntimeError(f"a warm-interpreter zygote did not start (said {line!r}); "
                               "XLA_FSDP_TEST_WARM=0 runs the suite without them")
    os.environ["XLA_FSDP_TEST_ZYGOTE"] = os.pathsep.join(socks)
    sys.executable = shim
    import multiprocessing.spawn

    multiprocessing.spawn.set_executable(shim)
    return zygotes
