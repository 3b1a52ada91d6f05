"""Starting processes that act as the hosts of one slice ([Note: virtual hosts] in xla_fsdp/runtime/hosts.py),
shared by the pod tests: a free port for their gloo group, each host's environment, and running a
set of them to the end."""
from __future__ import annotations

import os
import socket
import subprocess
from typing import Dict, Hashable, List, Tuple


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_env(hosts: int, index: int, port: int, devices: int) -> dict:
    """XLA:CPU with `devices` devices, host `index` of `hosts` (one host: no virtual-host variables)."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("XLA_USE_SPMD", "XLA_FSDP_VIRTUAL_HOSTS", "XLA_FSDP_VIRTUAL_HOST_INDEX"):
        env.pop(k, None)
    if hosts > 1:
        env.update(XLA_FSDP_VIRTUAL_HOSTS=str(hosts), XLA_FSDP_VIRTUAL_HOST_INDEX=str(index))
    return env


def start(jobs: Dict[Hashable, Tuple[List[str], dict]], cwd=None) -> Dict[Hashable, subprocess.Popen]:
    """{key: (argv, env)} -> {key: process}, all started at once (the hosts meet in their group)."""
    return {k: subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for k, (argv, env) in jobs.items()}


def finish(procs: Dict[Hashable, subprocess.Popen], timeout: float) -> Dict[Hashable, str]:
    """Wait for every process; fails naming the first that did not exit 0, with its output."""
    try:
        outs = {k: p.communicate(timeout=timeout)[0] for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for k, p in procs.items():
        assert p.returncode == 0, f"{k} failed ({p.returncode}):\n{outs[k][-4000:]}"
    return outs
