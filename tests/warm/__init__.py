"""Warm interpreters for the suite's child processes.

[Note: warm interpreters]
Most of this suite runs in child processes (workers at several device counts,
virtual hosts, launchers, the AOT check's tracer), and every fresh interpreter
spends ~7 s of CPU importing torch and the torch modules torch_xla imports
(dynamo, functorch, inductor) before any of our code runs: on this 2-core host
that was about half the suite's time. `start()` runs one zygote
(tests/warm/zygote.py) that has imported them, and points `sys.executable` and
multiprocessing's executable at a shim (tests/warm/shim.py) that has the
zygote fork each child with the shim's descriptors, environment, directory and
command line. torch_xla, xla_fsdp, jax and libtpu are still imported fresh in
every child, after its environment is set, so what depends on the environment
at import (PJRT_DEVICE, XLA_USE_SPMD, XLA_FLAGS, LIBTPU_INIT_ARGS) sees the
child's own. Command lines a forked child cannot honour (-X, -O, -I, -S,
PYTHONHASHSEED, ...) get the real interpreter. XLA_FSDP_TEST_WARM=0 turns
this off: every child is a fresh interpreter, as before.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def start(tmp: str):
    """Start the zygote and switch this process's children to the shim; returns the zygote or None."""
    if os.environ.get("XLA_FSDP_TEST_WARM", "1") == "0":
        return None
    real = sys.executable  # the venv's own path: its site-packages come with it
    shim = os.path.join(tmp, "python")
    with open(os.path.join(HERE, "shim.py")) as f:
        body = f.read()
    with open(shim, "w") as f:
        f.write(f"#!{real} -SE\n" + body)
    os.chmod(shim, os.stat(shim).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    sock = os.path.join(tmp, "zygote.sock")
    zygote = subprocess.Popen([real, os.path.join(HERE, "zygote.py"), sock, shim], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    line = zygote.stdout.readline()
    if line.strip() != "ready":
        zygote.kill()
        raise RuntimeError(f"the warm-interpreter zygote did not start (said {line!r}); "
                           "XLA_FSDP_TEST_WARM=0 runs the suite without it")
    os.environ["XLA_FSDP_TEST_ZYGOTE"] = sock
    sys.executable = shim
    import multiprocessing.spawn

    multiprocessing.spawn.set_executable(shim)
    return zygote
