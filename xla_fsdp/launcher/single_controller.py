"""One process driving every local device (the single controller) or one process per chip: what the flags, the
environment and the script's own declaration (xla_fsdp.runtime.choice) ask for, and what this device can run
([Note: no silent world on CPU])."""
from __future__ import annotations

from typing import Mapping

from xla_fsdp.launcher.command_line import (RUNTIME_ENV, RUNTIME_MARKER, SINGLE_CONTROLLER, UsageError)
from xla_fsdp.runtime import environment


def choose_spmd(options, script: str, device: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """(single controller?, why, when the script's declaration decided it). --spmd / --per_chip win; then the
    environment (`environment.runtime`: ours, then torch_xla's SPMD variable); then, on a TPU slice (one host or
    several), what the script declares (xla_fsdp.runtime.choice). On CPU, several devices and no choice here:
    cpu_replicas()."""
    from xla_fsdp.runtime import choice as runtime_choice

    try:
        runtime, why = runtime_choice.decide(options.spmd, options.per_chip, script, device == "TPU", environ)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return runtime == SINGLE_CONTROLLER, why


def declares_single_controller(script: str) -> bool:
    """Whether the script declares the single controller (xla_fsdp.runtime.choice)."""
    from xla_fsdp.runtime import choice as runtime_choice

    try:
        return runtime_choice.declared_runtime(script) == SINGLE_CONTROLLER
    except ValueError:
        return False


def per_chip_asked(options, environ: Mapping[str, str]) -> bool:
    """Whether the command asked for one process per device (--per_chip, the runtime variable: a bad value is a
    UsageError)."""
    if options.per_chip:
        return True
    try:
        return environment.runtime(environ) == environment.MULTI_PROCESS
    except ValueError as e:
        raise UsageError(str(e)) from None


def refuse_single_controller_only(script: str, device: str) -> None:
    """One process per device was asked for (--per_chip, the runtime variable) a script that runs only on the single
    controller: FSDP2's `fully_shard` (xla_fsdp.fsdp) refuses one process per chip, so say so before starting any
    replica."""
    from xla_fsdp.runtime import choice as runtime_choice

    try:
        tree = runtime_choice.parse_script(script)
    except (OSError, SyntaxError, ValueError):
        return
    if runtime_choice.imports_module(tree, runtime_choice.FSDP2_API):
        raise UsageError(
            f"{script} imports {runtime_choice.FSDP2_API}, whose fully_shard runs only on the single controller (one "
            f"process per host drives every {device} device, FSDP2's one rank per host), but one process per device "
            f"was asked for (--per_chip or {RUNTIME_ENV}={environment.MULTI_PROCESS}). Drop --per_chip (the script "
            "then runs as the single controller), or use xla_fsdp.XlaFullyShardedDataParallel, which runs one process "
            "per chip")


def cpu_replicas(options, script: str, num_cores: int, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Several CPU devices and no --spmd / runtime variable asking for the single controller: (True, why) when the
    script declares the single controller; otherwise a UsageError that says why not and what works.

    [Note: no silent world on CPU] One process per CPU device (torch_xla's xmp.spawn, threads on CPU) hangs in explicit
    collectives, so on CPU N > 1 devices exist only as the single controller, where a script sees xr.world_size() == 1
    and ordinal 0. A script written for one process per device (torch_xla's FSDP examples:
    DistributedSampler(num_replicas=xr.world_size()), lr scaled by the world) would silently run there as ONE replica of
    N, with one Nth of the global batch it was written for. So it runs at N > 1 only when someone said it is built for
    one controller."""
    if options.per_chip:
        asked = "--per_chip asks for one process per device"
    elif environment.get(RUNTIME_ENV, environ):
        asked = f"{RUNTIME_ENV}={environment.get(RUNTIME_ENV, environ)} asks for one process per device"
    else:
        from xla_fsdp.runtime import choice as runtime_choice

        try:
            declared = runtime_choice.declared_runtime(script)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if declared == SINGLE_CONTROLLER:
            return True, runtime_choice.tpu_default(script)[1].split(":")[0]
        asked = (f"{script} declares {RUNTIME_MARKER} = \"{declared}\"" if declared else f"{script} declares no "
                 f"runtime ({RUNTIME_MARKER}), so it is taken as written for torch_xla's one process per device")
    raise UsageError(
        f"--num_cores {num_cores} on CPU: {asked} (xr.world_size() == {num_cores}, an ordinal per process), which CPU "
        "cannot run: explicit XLA collectives between CPU devices hang (pytorch/xla issues 5005 and 9089). What runs "
        f"here: --num_cores 1 (one device, world 1); or --spmd --num_cores {num_cores} (one process drives the "
        f"{num_cores} devices: the script sees xr.world_size() == 1 and ordinal 0, so it must feed the whole global "
        f"batch, which xla_fsdp splits, with every parameter, over the {num_cores} devices; a script built for that "
        f"can declare {RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\"). One process per device runs on a TPU host")
