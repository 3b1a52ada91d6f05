"""What the launcher will do, decided before the script is imported: the PJRT device and how many of it (`--num_cores`),
the `LaunchPlan`, and the environment set before anything starts XLA (XLA's log level; on a TPU, libtpu's
async-collective flags and the slice's chip count)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Mapping, Optional

from xla_fsdp.runtime import environment
from xla_fsdp.launcher.command_line import (CPU_MAX_DEVICES, QUIET_XLA_LOG_LEVEL, RUNTIME_ENV, SINGLE_CONTROLLER,
                                            TPU_ENV_HINTS, UsageError, log)


def quiet_xla_logs() -> None:
    """Keep XLA's C++ warnings out of the job's output (one "GSPMD sharding propagation is going to be deprecated" per
    compile, which no user can act on); errors still print. A TF_CPP_MIN_LOG_LEVEL the user set wins (0 shows
    everything)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_XLA_LOG_LEVEL)


def async_collective_flags() -> None:
    """On a TPU, before libtpu starts and in the environment the replicas inherit: the async-collective libtpu flags
    (xla_fsdp.tpu.libtpu_flags), unless the user set LIBTPU_INIT_ARGS (theirs win, whole). Importing xla_fsdp sets them
    (that import is the one place they are set); this only says so."""
    from xla_fsdp.tpu import libtpu_flags

    users = libtpu_flags.users_own(os.environ)  # not the flags an earlier import of xla_fsdp set
    set_now = libtpu_flags.set_defaults(os.environ)
    if not users:
        log(f"{libtpu_flags.ENV}: xla_fsdp's async-collective flags for this runtime, {set_now} (set "
            f"{libtpu_flags.ENV} yourself to replace them)")


def slice_chips(local_chips: int, workers: Optional[Callable[[], int]] = None) -> int:
    """Chips of the whole slice: this host's times the TPU workers (hosts), or 0 if unknown."""
    try:
        if workers is None:
            from torch_xla._internal import tpu  # TPU-only path; reads the TPU VM's metadata

            workers = tpu.num_tpu_workers
        return local_chips * max(1, int(workers()))
    except Exception:  # no metadata: the budget stays the single controller's
        return 0


def detect_device(environ: Mapping[str, str], dev_root: str = "/dev") -> tuple[str, str]:
    """Return (PJRT device, where it came from) without initializing XLA."""
    if environment.get(environment.PJRT_DEVICE, environ):
        return environment.get(environment.PJRT_DEVICE, environ).upper(), "from environment"
    dev = Path(dev_root)
    # TPU v4 exposes /dev/accel<n>; v5e/v6e expose /dev/vfio/<n> (plus the /dev/vfio/vfio control node, which any VFIO
    # host has).
    has_tpu_files = any(dev.glob("accel*")) or any(p.name.isdigit() for p in dev.glob("vfio/*"))
    has_tpu_env = any(environment.get(name, environ) for name in TPU_ENV_HINTS)
    return ("TPU" if has_tpu_files or has_tpu_env else "CPU"), "detected"


def tpu_local_device_count() -> int:
    """Devices PJRT will use on this TPU host (one process per chip).

    Reads the PCI bus and the topology variables only; the XLA runtime is not started, so ``xmp.spawn`` can still run
    afterwards."""
    from torch_xla._internal import tpu  # TPU-only path; slow import.

    try:
        return tpu.num_local_processes() * tpu.num_logical_cores_per_chip()
    except Exception as e:  # no TPU here: torch_xla asks the metadata server, or parses what is not there
        first = (str(e).splitlines() or [""])[0][:200]
        raise UsageError(f"PJRT_DEVICE=TPU but this host's TPU could not be read ({type(e).__name__}: {first}); "
                         "run on a TPU VM, or set PJRT_DEVICE=CPU") from None


@dataclasses.dataclass(frozen=True)
class DeviceCounts:
    """The --num_cores values this host accepts."""

    device: str
    valid: tuple[int, ...]
    default: int

    def describe(self) -> str:
        if self.device == "CPU":
            return f"1..{CPU_MAX_DEVICES} (CPU devices are virtual)"
        return ", ".join(str(v) for v in self.valid)


def device_counts(device: str, spmd: bool, environ: Mapping[str, str],
                  local_devices: Callable[[], int] = tpu_local_device_count) -> DeviceCounts:
    if device == "CPU":
        default = environment.get(environment.CPU_NUM_DEVICES, environ) or "1"
        default_n = int(default) if default.isdigit() and 1 <= int(default) <= CPU_MAX_DEVICES else 1
        return DeviceCounts("CPU", tuple(range(1, CPU_MAX_DEVICES + 1)), default_n)
    if device == "TPU":
        every = local_devices()
        if every < 1:
            raise UsageError("PJRT_DEVICE=TPU but no TPU chip is visible on this host (check TPU_VISIBLE_CHIPS / "
                             "TPU_PROCESS_BOUNDS, or set PJRT_DEVICE=CPU)")
        # SPMD drives every addressable device from one process.
        valid = (every,) if spmd else tuple(sorted({1, every}))
        return DeviceCounts("TPU", valid, every)
    raise UsageError(f"PJRT_DEVICE={device} is not supported by this launcher; use PJRT_DEVICE=CPU or PJRT_DEVICE=TPU")


def parse_num_cores(text: Optional[str], counts: DeviceCounts, spmd: bool) -> int:
    if text is None:
        return counts.default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value not in counts.valid:
        raise UsageError(f"--num_cores {text!r} is not valid on this host (PJRT_DEVICE={counts.device}"
                         f"{' with --spmd' if spmd else ''}); valid values: {counts.describe()}")
    return value


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What the launcher will do, decided before the script is imported."""

    device: str
    num_cores: int
    spawn: bool  # True: xmp.spawn one process per chip; False: _mp_fn(0) here
    env: dict[str, str]  # variables set before the script is imported
    reason: str = ""  # one line shown when the launcher overrode the default


def make_plan(device: str, num_cores: int, spmd: bool) -> LaunchPlan:
    env = {"PJRT_DEVICE": device}
    if device == "CPU":
        env["CPU_NUM_DEVICES"] = str(num_cores)
    if spmd:
        env[RUNTIME_ENV] = SINGLE_CONTROLLER
        where = f"CPU_NUM_DEVICES={num_cores}" if device == "CPU" else "torch_xla's SPMD mode"
        return LaunchPlan(device, num_cores, False, env, reason=(
            f"one process drives the {num_cores} {device} devices (single-controller runtime: {RUNTIME_ENV}="
            f"{SINGLE_CONTROLLER}, {where}): the script runs once and sees xr.world_size() == 1 and ordinal 0 (one "
            "checkpoint file, shard metadata world_size 1); it feeds each global batch, which xla_fsdp splits, with "
            f"every parameter, over the {num_cores} devices"))
    if device == "CPU" and num_cores > 1:
        # cpu_replicas() refuses this before a plan is made ([Note: no silent world on CPU])
        raise UsageError(f"--num_cores {num_cores} on CPU runs only as the single controller (--spmd)")
    if num_cores == 1:
        if device == "TPU":
            # One process on one chip, as xmp.spawn(nprocs=1) would configure it.
            env.update(TPU_VISIBLE_CHIPS="0", TPU_CHIPS_PER_PROCESS_BOUNDS="1,1,1", TPU_PROCESS_BOUNDS="1,1,1")
        return LaunchPlan(device, num_cores, False, env)
    return LaunchPlan(device, num_cores, True, env)
