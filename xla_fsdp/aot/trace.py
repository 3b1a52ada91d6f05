"""Running a job's script in a traced child process and collecting the step's module.

The child (`xla_fsdp/aot/child.py`) runs on XLA:CPU with as many virtual devices as the slice has chips, in the
runtime the job would use on the slice; it writes `program.txt` (the module torch_xla hands to XLA for the second
step) into the work directory and ends. This module builds its environment, runs it, and turns its failures into
messages that say where.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from xla_fsdp.aot.dump import MARKER, PROGRAM, REFUSED, crash_report, take_program
from xla_fsdp.aot.child import MAX_DEVICE_INDEX
from xla_fsdp.runtime import choice as runtime_choice
from xla_fsdp.runtime import environment
from xla_fsdp.runtime.environment import MULTI_PROCESS, RUNTIME, RUNTIMES, SINGLE_CONTROLLER  # noqa: F401 (tests name it here)

LAUNCHER = "xla_spawn.py"
# the check's settings (environment.AOT), JSON. A user may give "rank_0_alone" (true: trace one process per chip on one
# device at any size) and "poll_s" (seconds between the traced process's looks at XLA's dump; tests set it past
# XLA:CPU's compile to make the traced process die first); `child_env` adds the rest: "out" (the capture's folder),
# "steps" (2), "dump" (XLA's dump folder), ...


class TraceError(RuntimeError):
    """The job could not be traced; the message says where."""


@dataclass
class Job:
    """What to trace: a script and its flags, in a runtime, at a device count."""

    script: str
    args: List[str]
    runtime: str
    devices: int
    torus: str = ""  # the slice's devices per axis, x first ("2x2x4"); the engine reads it
    env: Dict[str, str] = field(default_factory=dict)  # set in the traced child (the check's retries)


def job_from_command(command: List[str], runtime: str, devices: int) -> Job:
    """The job of `command` (`script.py flags...`, or `launch/xla_spawn.py [--num_cores N] [--spmd] script.py
    flags...` as users launch it); `runtime` "auto" means the runtime the command would use on the slice."""
    if not command:
        raise TraceError("no script given: put the job's command after --, e.g. "
                         "python -m xla_fsdp.aot --tpu v4-8 -- launch/run_clm.py --config_name ...")
    flags = set()
    if os.path.basename(command[0]) == LAUNCHER:
        rest = command[1:]
        while rest and rest[0].startswith("--"):
            flag = rest.pop(0)
            if flag == "--num_cores" and rest:  # the slice decides the device count here
                rest.pop(0)
            elif flag not in ("--spmd", "--per_chip", "--num_cores") and not flag.startswith("--num_cores="):
                raise TraceError(f"unknown {LAUNCHER} flag {flag!r} before the script")
            flags.add(flag)
        command = rest
        if not command:
            raise TraceError(f"{LAUNCHER} was given no training script")
    script, args = command[0], list(command[1:])
    if not os.path.isfile(script):
        raise TraceError(f"script {script!r} not found (run from the directory the job runs from)")
    return Job(script, args, runtime_for(runtime, "--spmd" in flags, "--per_chip" in flags, script), devices)


def runtime_for(requested: str, spmd_flag: bool, per_chip: bool = False, script: str = "") -> str:
    """The runtime the job uses on a TPU, as xla_spawn chooses it: `--spmd` / `--per_chip`; else the environment; else
    what the script declares (`xla_fsdp.runtime.choice`); else one process per chip."""
    if requested != "auto":
        if requested not in RUNTIMES:
            raise TraceError(f"--runtime {requested!r}: expected auto, {' or '.join(RUNTIMES)}")
        return requested
    try:
        return runtime_choice.decide(spmd_flag, per_chip, script, on_tpu=True)[0]  # as xla_spawn decides
    except ValueError as e:
        raise TraceError(str(e)) from None


def rank_0_alone(job: Job) -> bool:
    """Whether one device traces rank 0 of a per-chip job ([Note: rank 0 alone past 127 chips])."""
    return job.runtime == MULTI_PROCESS and (job.devices > MAX_DEVICE_INDEX or bool(environment.aot().get("rank_0_alone")))


def _with_replica_count(text: str, replicas: int) -> str:
    """The module header with the slice's replica count, which XLA left out as one device traced it."""
    header, _, rest = text.partition("\n")
    return text if "replica_count=" in header else f"{header}, replica_count={replicas}\n{rest}"


def child_env(job: Job, workdir: str, steps: int) -> dict:
    """The traced child's environment: XLA:CPU at the slice's device count, tracing on, XLA dumping the module."""
    dump = os.path.join(workdir, "dump")
    os.makedirs(dump, exist_ok=True)
    env = dict(os.environ)
    for name in ("TPU_ACCELERATOR_TYPE", "TPU_PROCESS_BOUNDS", "TPU_VISIBLE_CHIPS", environment.TORCH_XLA_SPMD):
        env.pop(name, None)  # this host's devices are the slice's stand-ins
    alone = rank_0_alone(job)
    settings = {**environment.aot(env), **environment.aot(job.env)}  # the user's, then the job's (fit_report)
    settings.update(trace=True, out=workdir, steps=steps, dump=dump,
                    world=job.devices if alone else None)  # [Note: rank 0 alone past 127 chips]
    env.update({
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": "1" if alone else str(job.devices),
        RUNTIME: job.runtime,
        "XLA_HLO_DEBUG": env.get("XLA_HLO_DEBUG", "1"),  # source lines in op metadata, for messages
        "XLA_FLAGS": (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                      " --xla_dump_hlo_pass_re=^$").strip(),
        "TF_CPP_MIN_LOG_LEVEL": env.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        "PYTHONUNBUFFERED": "1",
    })
    if not env.get("MASTER_PORT"):
        # [Note: the traced child's rendezvous port] A script's `init_process_group(init_method="xla://")` opens
        # torch_xla's TCP store on MASTER_PORT (12355 unless set). The traced child stands in for one host alone, so
        # any free local port serves, and another job on this host holding 12355 must not fail the check.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    if job.torus:  # the slice the step is checked for, not this host's stand-in devices
        env[environment.TORUS] = job.torus
    env.update(job.env)
    env[environment.AOT] = environment.with_aot({}, **settings)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def run_trace(job: Job, workdir: str, steps: int = 2, timeout: Optional[float] = None,
              echo=None) -> str:
    """Trace `job` in a child process; the step's module text (a TraceError with the child's last lines on failure)."""
    cmd = [sys.executable, "-m", "xla_fsdp.aot.child", job.script, *job.args]
    log_path = os.path.join(workdir, "trace.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(job, workdir, steps), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        try:
            for line in proc.stdout:
                log.write(line)
                if echo is not None:
                    echo(line.rstrip("\n"))
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise TraceError(f"tracing {job.script} took longer than {timeout:.0f} s (log: {log_path})")
        finally:
            if proc.poll() is None:
                proc.kill()
    # the module, whole in XLA's dump, is what counts, however the traced process ended
    # ([Note: the module is taken from the dump, whoever gets there first] in dump.py)
    program = os.path.join(workdir, PROGRAM)
    if take_program(workdir, os.path.join(workdir, "dump")):
        text = open(program).read()
        if rank_0_alone(job):
            text = _with_replica_count(text, job.devices)
            with open(program, "w") as f:  # what --dump keeps
                f.write(text)
        return text
    lines = open(log_path).readlines()
    refused = os.path.join(workdir, REFUSED)
    if os.path.exists(refused):  # the script ended itself (sys.exit): its message is the whole story
        with open(refused) as f:
            ended = json.load(f)
        said = ended["message"] or next((l.strip() for l in reversed(lines) if l.strip()), "")
        raise TraceError(f"{job.script} failed before its second training step (exit status {ended['code']}): {said}")
    tail = "".join(lines[-25:])
    where = ("in its second training step's compile" if os.path.exists(os.path.join(workdir, MARKER))
             else "before its second training step")
    crash = crash_report(workdir)
    crash = f"\nIt died on a signal:\n{crash}\n" if crash else ""
    raise TraceError(f"{job.script} failed {where} while traced at {job.devices} devices ({job.runtime}), "
                     f"{_exit_text(proc.returncode)}. Its last lines:\n{tail}{crash}\n(full log: {log_path})")


def _exit_text(returncode: int) -> str:
    if returncode is not None and returncode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
