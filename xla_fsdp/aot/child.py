"""The traced process: runs a user's training script at a TPU slice's device count on XLA:CPU.

    python -m xla_fsdp.aot.child SCRIPT [SCRIPT_ARGS...]

Started by `python -m xla_fsdp.aot` with the environment it needs (`PJRT_DEVICE=CPU`, `CPU_NUM_DEVICES`,
`environment.RUNTIME`, the trace and dump variables). The script runs as `xla_spawn.py` would run it: its
`_mp_fn(index)` if it has one, else as `__main__`.
- single controller: one process drives every device, as on a TPU host;
- one process per chip: torch_xla's device threads stand in for the processes, and only rank 0 traces (every
  rank's program is the same text: [Note: rank as data]); the others return at once. Nothing collective runs
  while tracing, so rank 0 never waits for them. Past 127 chips one device stands in for rank 0 alone ([Note:
  rank 0 alone past 127 chips]).
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import traceback

EXIT_NO_SECOND_STEP = 3
MAX_DEVICE_INDEX = 127  # c10::DeviceIndex is int8


def _run_script(script: str, args) -> None:
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if not _defines_mp_fn(script):
        runpy.run_path(script, run_name="__main__")
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("__aot_script__", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._mp_fn(0)


def _defines_mp_fn(script: str) -> bool:
    """Whether the script defines xla_spawn's entry `_mp_fn` at top level (read, not run)."""
    import ast

    with open(script) as f:
        tree = ast.parse(f.read(), script)
    return any(isinstance(n, ast.FunctionDef) and n.name == "_mp_fn" for n in tree.body)


def _serial_backward_beyond_device_index() -> None:
    """[Note: 128 chips and up in one traced process]

    The check stands one XLA:CPU device in for every chip. PyTorch's autograd engine sizes its per-device queues
    from the device count in a c10::DeviceIndex, 8 signed bits: at 128 devices and more the count wraps, the engine
    makes no XLA queue, and the first backward fails with an INTERNAL ASSERT on device_ready_queues_. With
    autograd's multithreading off, backward runs in the calling thread on the CPU queue, which never looks at the
    device count; for a lazy XLA tensor that records the same graph. The switch is thread-local, so it covers a
    script that trains on its main thread (run_clm, the Trainer, a plain loop), and is set only where the count
    wraps. On a real pod each host's process drives only its own chips."""
    import torch

    from xla_fsdp.runtime import environment

    if int(environment.get(environment.CPU_NUM_DEVICES) or 0) > MAX_DEVICE_INDEX:
        torch.autograd.set_multithreading_enabled(False)  # sets it now, for this thread


_crash_file = None
_crash_lock = threading.Lock()


def _record_crashes() -> None:
    """A traced process that dies on a signal (XLA aborting, a segfault) says where in `crash.txt` beside the
    module; the check shows it when it got no module. Every device thread of the pool worker calls it: the file is
    opened once, under a lock (two threads must not each open it, truncating), and the handler installed again by
    each caller, so whatever ran in between (the XLA runtime starting in another thread) cannot leave it off."""
    global _crash_file
    import faulthandler

    with _crash_lock:
        if _crash_file is None:
            from xla_fsdp.aot import capture
            from xla_fsdp.aot.dump import CRASH

            _crash_file = open(os.path.join(capture._spec()["out"], CRASH), "w")
        faulthandler.enable(file=_crash_file, all_threads=True)


def _traced(script: str, args) -> None:
    from xla_fsdp.aot import capture

    try:
        _serial_backward_beyond_device_index()
        capture.install()
        _record_crashes()  # the crash handler installed last before the job's own code runs
        _run_script(script, args)
    except SystemExit as e:
        if e.code not in (None, 0):
            from xla_fsdp.aot.dump import REFUSED

            # the script ended itself (as a rule a mistake in its flags or files): the check says why in one line
            # (xla_fsdp.aot.trace), from its message or, for an exit status, its last printed line (argparse's)
            code, message = (e.code, None) if isinstance(e.code, int) else (1, str(e.code))
            with open(os.path.join(capture._spec()["out"], REFUSED), "w") as f:
                json.dump({"code": code, "message": message}, f)
            os._exit(code)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"xla_fsdp.aot: {script} returned after {capture._State.cuts} graph cut(s); the check needs two "
          "training steps, each ending in torch_xla.sync() or xm.mark_step() (--steps sets how many)",
          file=sys.stderr)
    sys.stderr.flush()
    os._exit(EXIT_NO_SECOND_STEP)


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    _record_crashes()
    from xla_fsdp.runtime import environment
    from xla_fsdp.runtime.choice import enter_single_controller

    if environment.runtime() == environment.SINGLE_CONTROLLER:
        enter_single_controller()  # as launch/xla_spawn.py does before the script runs
        _traced(script, args)
        return
    import torch_xla.distributed.xla_multiprocessing as xmp

    from xla_fsdp.aot import capture
    from xla_fsdp.aot.dump import take_program

    try:
        xmp.spawn(_replica, args=(script, args))
    except BaseException as e:
        # The pool's worker always ends abruptly: rank 0 leaves it with os._exit (done, or failed after printing
        # why), or XLA:CPU crashes it running the step on placeholders once the module is dumped ([Note: the module
        # is taken from the dump, whoever gets there first] in dump.py). Only the dump tells which.
        if take_program(capture._spec()["out"], capture._spec()["dump"]):
            os._exit(0)
        print(f"xla_fsdp.aot: the traced process of one process per chip ended before the step's "
              f"module was whole ({type(e).__name__}: {e})", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def _replica(index: int, script: str, args) -> None:
    _record_crashes()  # this runs in torch_xla's pool worker, a process of its own
    from xla_fsdp.aot import capture

    world = capture._spec().get("world")  # set: one device traces rank 0 of a world this size
    if world:
        _stand_in_for_rank_0(int(world))
    if index == 0:
        _traced(script, args)


def _stand_in_for_rank_0(world: int) -> None:
    """[Note: rank 0 alone past 127 chips]

    One process per chip is traced with one torch_xla device thread per chip, and only rank 0's program is kept.
    torch_xla hands each thread its ordinal through the device index, a c10::DeviceIndex of 8 signed bits: from the
    129th thread on it wraps, dozens of threads read ordinal 0, and each traces the job at once (racing on imports,
    on the captured program and on the device). Rank 0's program depends on the world only through the number
    torch_xla reports (shard sizes, collectives' shard counts; replica groups stay "all replicas"), and nothing
    collective runs while tracing. So past 127 chips the child gets one device (trace.child_env) and this sets the
    world torch_xla reports to the slice's chip count, in the spawned process, before the script runs.
    tests/test_aot.py traces the same job both ways at 8 chips and compares the programs."""
    import torch_xla.runtime as xr

    xr._WORLD_SIZE = world  # what xr.world_size() (and xm's collectives) read


if __name__ == "__main__":
    main()
