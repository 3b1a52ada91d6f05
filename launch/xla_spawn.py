"""Launch a training script on XLA devices (PJRT runtime).

Usage (compatible with the Hugging Face / torch_xla ``xla_spawn.py``)::

    python launch/xla_spawn.py [--num_cores N] [--spmd | --per_chip] path/to/train.py --its --own --flags

Launcher flags come before the script path; everything after it reaches the
script untouched (even ``--num_cores`` or ``--help``), with
``sys.argv == [script_path, *script_args]``. Two kinds of script:

- Hugging Face's convention: the script is imported by path and its
  ``_mp_fn(index)`` is called once per replica.
- torch_xla's: the script starts itself, ``if __name__ == "__main__":
  xmp.spawn(_mp_fn, args=(FLAGS,))`` (or ``torch_xla.launch``). Its own
  ``__main__`` runs, with its own arguments, and its call is routed to the
  runtime chosen below: ``fn(index, *args)`` as torch_xla calls it
  (xla_fsdp/runtime/self_starting.py). An ``fn`` that cannot take the index and
  ``args`` is refused by name.
- A plain script (torchrun-style: no ``_mp_fn``, ``if __name__ == "__main__":
  main()``, as FSDP2 scripts are) under the single controller, or at
  ``--num_cores 1`` when it declares the single controller (an FSDP2 script
  does by importing ``xla_fsdp.fsdp``): it runs once, as ``python script.py``
  would. One process per chip needs ``_mp_fn``.

What runs where (the world is what ``xr.world_size()`` says in the script):

============  ==============  ================================================
device        --num_cores     behaviour
============  ==============  ================================================
any           1               one replica in this process, world 1
CPU           2..64           only the single controller (below), and only when
                              chosen: ``--spmd``, ``XLA_FSDP_RUNTIME=single_controller``
                              or the script's ``XLA_FSDP_TPU_RUNTIME =
                              "single_controller"``; anything else is refused,
                              exit 2 (one process per CPU device would hang)
TPU           every local     ``xmp.spawn``: one process per chip, world N,
              device          unless the script declares ``XLA_FSDP_TPU_RUNTIME =
                              "single_controller"`` (``launch/run_clm.py`` does):
                              then one process per host (below)
any + --spmd  (see --help)    single controller: one process per host drives every
                              local device (torch_xla's SPMD mode, turned on here
                              before the script runs); the script sees world 1 and
                              ordinal 0, feeds each global batch, and xla_fsdp splits
                              it, and every parameter, over the devices
TPU + --per_chip              one process per chip whatever the script declares
============  ==============  ================================================

``XLA_FSDP_RUNTIME=single_controller`` / ``multi_process`` in the environment
chooses as ``--spmd`` / ``--per_chip`` do; so does torch_xla's ``XLA_USE_SPMD=1``
for the single controller. The launcher prints its choice and the
world the script will see in one line. On a TPU the launcher also sets
libtpu's async-collective flags in ``LIBTPU_INIT_ARGS`` unless you set it
(``xla_fsdp.tpu.libtpu_flags``).

The engine is the script's choice (``xla_fsdp_v2`` in the fsdp config, or
``XLA_FSDP_ENGINE=spmd``, selects the GSPMD engine; the collective engine runs
in either runtime). Why CPU never spawns several replicas: explicit XLA
collectives between processes (device threads, on CPU) race their compiles and
hang (pytorch/xla issues 5005 and 9089), while one process driving N virtual
devices runs the same collectives inside one SPMD program. A script written
for one process per device (torch_xla's FSDP examples) would see world 1 there
and shard its data for one replica, so on CPU it runs at N > 1 only when asked.

TPU subsets: PJRT runs one process per chip and uses every chip the host's
topology exposes, so the valid counts are 1 and "every local device". To use
fewer chips, restrict the topology yourself with the documented variables
(``TPU_PROCESS_BOUNDS``, ``TPU_CHIPS_PER_PROCESS_BOUNDS``,
``TPU_VISIBLE_CHIPS``); the launcher counts the devices those leave visible.

Multi-host pods: run the *same* command on every worker
(``gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...``, as
``tpu_scripts/run.sh`` does). PJRT reads the pod topology from the TPU
metadata on each worker and joins the processes of all workers into one job;
the launcher needs no address or rank flags. ``--num_cores`` counts the
devices of one worker; ``--num_cores 1`` on a pod worker runs a separate
one-chip job there, which is only useful for debugging.

Failures: if a replica raises, the launcher prints that replica's traceback and
exits 1; in the spawn path the failing replica exits at once so the process
pool breaks and the remaining replicas are terminated instead of waiting
forever in a collective. Ctrl-C stops every replica and exits 130. Usage errors
(bad ``--num_cores``, missing script, missing ``_mp_fn``, an entry point that
cannot take what it is passed, a runtime this machine cannot run) exit 2 without
a traceback.

``PJRT_DEVICE`` is detected when unset: TPU when TPU device files
(``/dev/accel*``, ``/dev/vfio/<n>``) or TPU environment variables are present,
else CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import multiprocessing
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable, Mapping, Optional

PROG = "xla_spawn"
# CPU devices are virtual, so any count works; the cap only catches typos
# (e.g. 400 for 4) before they build hundreds of device threads.
CPU_MAX_DEVICES = 64
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ENTRY_POINT = "_mp_fn"
# read by the training job (xla_fsdp.train.model.single_controller)
RUNTIME_ENV = "XLA_FSDP_RUNTIME"
QUIET_XLA_LOG_LEVEL = "2"  # TensorFlow's convention: 2 hides INFO and WARNING, keeps ERROR
SINGLE_CONTROLLER = "single_controller"
RUNTIME_MARKER = "XLA_FSDP_TPU_RUNTIME"  # a script's declared TPU runtime (xla_fsdp.runtime.choice)
# Variables the TPU VM image or a pod's runtime sets; any one means "on a TPU".
TPU_ENV_HINTS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
                 "TPU_PROCESS_BOUNDS", "TPU_SKIP_MDS_QUERY")
TORCH_XLA_SPMD_ENV = "XLA_USE_SPMD"


class UsageError(Exception):
    """A mistake in the command line: reported as one message, exit 2."""


def quiet_xla_logs() -> None:
    """Keep XLA's C++ warnings out of the job's output (one "GSPMD sharding propagation is
    going to be deprecated" per compile, which no user can act on); errors still print.
    A TF_CPP_MIN_LOG_LEVEL the user set wins (0 shows everything)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_XLA_LOG_LEVEL)


def async_collective_flags() -> None:
    """On a TPU, before libtpu starts and in the environment the replicas inherit: the
    async-collective libtpu flags (xla_fsdp.tpu.libtpu_flags), unless the user set
    LIBTPU_INIT_ARGS (theirs win, whole). Importing xla_fsdp sets them (that import is the
    one place they are set); this only says so."""
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


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Command line


def split_argv(argv: list[str]) -> tuple[list[str], Optional[str], list[str]]:
    """Split ``argv`` into launcher flags, the script path and the script's args.

    The script path is the first token that is neither a flag nor the value of
    ``--num_cores``; nothing after it is looked at, so a script flag that
    shares a launcher flag's name is never taken by the launcher.
    """
    launcher: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            rest = argv[i + 1:]
            return launcher, (rest[0] if rest else None), rest[1:]
        if not token.startswith("-") or token == "-":
            return launcher, token, argv[i + 1:]
        launcher.append(token)
        if token == "--num_cores" and i + 1 < len(argv):
            launcher.append(argv[i + 1])
            i += 1
        i += 1
    return launcher, None, []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG}.py",
        usage="%(prog)s [--num_cores N] [--spmd | --per_chip] SCRIPT [SCRIPT_ARGS ...]",
        description="Run SCRIPT's _mp_fn(index), or the xmp.spawn / torch_xla.launch "
                    "call of a script that starts itself, on XLA devices. Everything after "
                    "SCRIPT is passed to it untouched.",
        epilog=f"On CPU, --num_cores takes 1..{CPU_MAX_DEVICES}; N>1 runs only as one "
               "process driving the N devices (--spmd, or a script that declares "
               f"{RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\"), where the script sees "
               "world 1; one process per CPU device would hang on explicit collectives. "
               "On TPU it takes 1 or every local device. On a multi-host pod run the "
               "same command on every worker.")
    parser.add_argument(
        "--num_cores", default=None, metavar="N",
        help="number of XLA devices (replicas) on this host; default: every "
             "local device (on CPU: $CPU_NUM_DEVICES, else 1)")
    parser.add_argument(
        "--spmd", action="store_true",
        help="one process per host driving every local device (torch_xla's SPMD "
             "runtime, turned on before the script runs; the single-controller runtime "
             "of the collective engine, or the GSPMD engine): sets "
             "XLA_FSDP_RUNTIME=single_controller and runs one replica, index 0, which "
             "sees xr.world_size() == 1 and feeds the global batch")
    parser.add_argument(
        "--per_chip", action="store_true",
        help="one process per chip (torch_xla's xmp.spawn; pinned collectives), also for a "
             f"script that declares {RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\" (launch/run_clm.py does); "
             "a script that declares nothing runs this way on a TPU by default. TPU only at "
             "--num_cores > 1")
    return parser


def choose_spmd(options, script: str, device: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """(single controller?, why, when the script's declaration decided it). --spmd / --per_chip
    win; then XLA_FSDP_RUNTIME; then torch_xla's own XLA_USE_SPMD=1; then, on a TPU slice (one
    host or several), what the script declares (xla_fsdp.runtime.choice). On CPU, several
    devices and no choice here: cpu_replicas()."""
    if options.spmd and options.per_chip:
        raise UsageError("--spmd and --per_chip contradict each other; pass one")
    if options.spmd or options.per_chip:
        return options.spmd, ""
    if environ.get(RUNTIME_ENV, "").strip():
        return environ[RUNTIME_ENV].strip().lower() == SINGLE_CONTROLLER, ""
    if environ.get(TORCH_XLA_SPMD_ENV, "").strip().lower() in ("1", "true", "yes"):
        # torch_xla's is_spmd() reads it: the script runs in SPMD mode whatever the launcher plans
        return True, f"{TORCH_XLA_SPMD_ENV}=1 in the environment: torch_xla's SPMD mode, the single controller"
    if device != "TPU":
        return False, ""
    from xla_fsdp.runtime import choice as runtime_choice

    try:
        runtime, why = runtime_choice.tpu_default(script)
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
    """Whether the command asked for one process per device (--per_chip, XLA_FSDP_RUNTIME)."""
    return bool(options.per_chip) or environ.get(RUNTIME_ENV, "").strip().lower() == "multi_process"


def refuse_single_controller_only(script: str, device: str) -> None:
    """One process per device was asked for (--per_chip, XLA_FSDP_RUNTIME) a script that runs only
    on the single controller: FSDP2's `fully_shard` (xla_fsdp.fsdp) refuses one process per chip,
    so say so before starting any replica."""
    from xla_fsdp.runtime import choice as runtime_choice

    try:
        tree = runtime_choice.parse_script(script)
    except (OSError, SyntaxError, ValueError):
        return
    if runtime_choice.imports_module(tree, runtime_choice.FSDP2_API):
        raise UsageError(
            f"{script} imports {runtime_choice.FSDP2_API}, whose fully_shard runs only on the single controller "
            f"(one process per host drives every {device} device, FSDP2's one rank per host), but one process "
            "per device was asked for (--per_chip or XLA_FSDP_RUNTIME=multi_process). Drop --per_chip (the "
            "script then runs as the single controller), or use xla_fsdp.XlaFullyShardedDataParallel, which "
            "runs one process per chip")


def cpu_replicas(options, script: str, num_cores: int, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Several CPU devices and no --spmd / XLA_FSDP_RUNTIME=single_controller: (True, why) when the
    script declares the single controller; otherwise a UsageError that says why not and what works.

    [Note: no silent world on CPU] One process per CPU device (torch_xla's xmp.spawn, threads on
    CPU) hangs in explicit collectives, so on CPU N > 1 devices exist only as the single
    controller, where a script sees xr.world_size() == 1 and ordinal 0. A script written for one
    process per device (torch_xla's FSDP examples: DistributedSampler(num_replicas=xr.world_size()),
    lr scaled by the world) would run there as ONE replica of N, with one Nth of the global batch
    it was written for; before this check it even ran on one device of the N it was told about.
    So it runs at N > 1 only when someone said it is built for one controller.
    """
    if options.per_chip:
        asked = "--per_chip asks for one process per device"
    elif environ.get(RUNTIME_ENV, "").strip():
        asked = f"{RUNTIME_ENV}={environ[RUNTIME_ENV].strip()} asks for one process per device"
    else:
        from xla_fsdp.runtime import choice as runtime_choice

        try:
            declared = runtime_choice.declared_runtime(script)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if declared == SINGLE_CONTROLLER:
            return True, runtime_choice.tpu_default(script)[1].split(":")[0]
        asked = (f"{script} declares {RUNTIME_MARKER} = \"{declared}\"" if declared else
                 f"{script} declares no runtime ({RUNTIME_MARKER}), so it is taken as written for "
                 "torch_xla's one process per device")
    raise UsageError(
        f"--num_cores {num_cores} on CPU: {asked} (xr.world_size() == {num_cores}, an ordinal per "
        "process), which CPU cannot run: explicit XLA collectives between CPU devices hang "
        "(pytorch/xla issues 5005 and 9089). What runs here: --num_cores 1 (one device, world 1); or "
        f"--spmd --num_cores {num_cores} (one process drives the {num_cores} devices: the script sees "
        "xr.world_size() == 1 and ordinal 0, so it must feed the whole global batch, which xla_fsdp "
        f"splits, with every parameter, over the {num_cores} devices; a script built for that can "
        f"declare {RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\"). One process per device runs on a TPU host")


# --------------------------------------------------------------------------
# Devices


def detect_device(environ: Mapping[str, str], dev_root: str = "/dev") -> tuple[str, str]:
    """Return (PJRT device, where it came from) without initializing XLA."""
    if environ.get("PJRT_DEVICE"):
        return environ["PJRT_DEVICE"].upper(), "from environment"
    dev = Path(dev_root)
    # TPU v4 exposes /dev/accel<n>; v5e/v6e expose /dev/vfio/<n> (plus the
    # /dev/vfio/vfio control node, which any VFIO host has).
    has_tpu_files = any(dev.glob("accel*")) or any(
        p.name.isdigit() for p in dev.glob("vfio/*"))
    has_tpu_env = any(environ.get(name) for name in TPU_ENV_HINTS)
    return ("TPU" if has_tpu_files or has_tpu_env else "CPU"), "detected"


def tpu_local_device_count() -> int:
    """Devices PJRT will use on this TPU host (one process per chip).

    Reads the PCI bus and the topology variables only; the XLA runtime is not
    started, so ``xmp.spawn`` can still run afterwards.
    """
    from torch_xla._internal import tpu  # TPU-only path; slow import.

    return tpu.num_local_processes() * tpu.num_logical_cores_per_chip()


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
        default = environ.get("CPU_NUM_DEVICES", "1")
        default_n = int(default) if default.isdigit() and 1 <= int(default) <= CPU_MAX_DEVICES else 1
        return DeviceCounts("CPU", tuple(range(1, CPU_MAX_DEVICES + 1)), default_n)
    if device == "TPU":
        every = local_devices()
        if every < 1:
            raise UsageError("PJRT_DEVICE=TPU but no TPU chip is visible on this host "
                             "(check TPU_VISIBLE_CHIPS / TPU_PROCESS_BOUNDS, or set "
                             "PJRT_DEVICE=CPU)")
        # SPMD drives every addressable device from one process.
        valid = (every,) if spmd else tuple(sorted({1, every}))
        return DeviceCounts("TPU", valid, every)
    raise UsageError(f"PJRT_DEVICE={device} is not supported by this launcher; "
                     "use PJRT_DEVICE=CPU or PJRT_DEVICE=TPU")


def parse_num_cores(text: Optional[str], counts: DeviceCounts, spmd: bool) -> int:
    if text is None:
        return counts.default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value not in counts.valid:
        mode = " with --spmd" if spmd else ""
        raise UsageError(f"--num_cores {text!r} is not valid on this host "
                         f"(PJRT_DEVICE={counts.device}{mode}); valid values: "
                         f"{counts.describe()}")
    return value


# --------------------------------------------------------------------------
# Plan


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
            f"one process drives the {num_cores} {device} devices (single-controller runtime: "
            f"{RUNTIME_ENV}={SINGLE_CONTROLLER}, {where}): the script runs once and sees "
            "xr.world_size() == 1 and ordinal 0 (one checkpoint file, shard metadata world_size 1); "
            f"it feeds each global batch, which xla_fsdp splits, with every parameter, over the "
            f"{num_cores} devices"))
    if device == "CPU" and num_cores > 1:
        # cpu_replicas() refuses this before a plan is made ([Note: no silent world on CPU])
        raise UsageError(f"--num_cores {num_cores} on CPU runs only as the single controller (--spmd)")
    if num_cores == 1:
        if device == "TPU":
            # One process on one chip, as xmp.spawn(nprocs=1) would configure it.
            env.update(TPU_VISIBLE_CHIPS="0", TPU_CHIPS_PER_PROCESS_BOUNDS="1,1,1",
                       TPU_PROCESS_BOUNDS="1,1,1")
        return LaunchPlan(device, num_cores, False, env)
    return LaunchPlan(device, num_cores, True, env)


# --------------------------------------------------------------------------
# Running the script


@dataclasses.dataclass(frozen=True)
class ScriptEntry:
    """The script's ``_mp_fn``, loadable in this process or in a spawned replica.

    Picklable (paths and strings only), so spawned replicas import the script
    themselves instead of receiving a function object.
    """

    script: str
    args: tuple[str, ...]

    def load(self) -> Callable[[int], object]:
        path = Path(self.script)
        sys.argv = [self.script, *self.args]
        # What `python train.py` would do: the script's folder comes first, so
        # its sibling modules import.
        sys.path.insert(0, str(path.resolve().parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        # Registered under its own name so objects the script pickles (e.g. for
        # DataLoader workers) can be found again.
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        fn = getattr(module, ENTRY_POINT, None)
        if not callable(fn):
            raise UsageError(f"{self.script} defines no function {ENTRY_POINT}(index); "
                             f"add `def {ENTRY_POINT}(index): main()` to it, or start the script "
                             f"itself under `if __name__ == \"__main__\":` with xmp.spawn(fn, args=...)")
        try:
            inspect.signature(fn).bind(0)
        except TypeError as e:
            from xla_fsdp.runtime.self_starting import describe

            raise UsageError(
                f"{self.script}: xla_spawn calls {ENTRY_POINT}(index), the replica index alone, because the "
                f"script does not start itself (no xmp.spawn or torch_xla.launch call), but "
                f"{describe(fn)} cannot be called so ({e}). Give its other parameters defaults, or end "
                f"the script with `if __name__ == \"__main__\": xmp.spawn({ENTRY_POINT}, args=(...))`, "
                "which xla_spawn then runs with the script's own arguments") from None
        except ValueError:
            pass  # no signature to read: the call will say
        return fn

    def __call__(self, index: int) -> None:
        """Replica body in the spawn path: any failure ends this process now, which breaks the
        parent's process pool (xla_fsdp.runtime.self_starting.ReplicaCall)."""
        from xla_fsdp.runtime.self_starting import ReplicaCall

        ReplicaCall(lambda i: self.load()(i), ())(index)


def defines_entry_point(script: str) -> bool:
    """Whether `script` defines ``_mp_fn`` at module level (read, not imported)."""
    import ast

    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), filename=script)
    except (OSError, SyntaxError, ValueError):
        return True  # importing it will say what is wrong
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == ENTRY_POINT:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == ENTRY_POINT for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" or (a.asname or a.name.split(".")[0]) == ENTRY_POINT for a in node.names):
                return True
    return False


def run_as_main(entry: "ScriptEntry") -> int:
    """Run the script as ``python script.py args...`` would, here (the single controller)."""
    import runpy

    sys.argv = [entry.script, *entry.args]
    sys.path.insert(0, str(Path(entry.script).resolve().parent))
    try:
        runpy.run_path(entry.script, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc)
    except Exception:
        log(f"{entry.script} failed:\n{traceback.format_exc()}")
        return EXIT_FAILED
    return 0


def run_in_process(fn: Callable[[int], object]) -> int:
    """Call ``fn(0)`` here; a failure becomes a traceback and exit 1.

    KeyboardInterrupt is left to main(), which owns the exit-130 path.
    """
    try:
        fn(0)
    except SystemExit as exc:
        return exit_code(exc)
    except Exception:
        log(f"replica 0 failed:\n{traceback.format_exc()}")
        return EXIT_FAILED
    return 0


def exit_code(exc: SystemExit) -> int:
    """The process exit status `sys.exit(exc.code)` would give."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else EXIT_FAILED


def run_spawned(entry: Callable[[int], None], spawn: Optional[Callable] = None,
                start_method: str = "spawn") -> int:
    """One process per chip through torch_xla's spawn (`spawn`: its original, when a
    self-starting script's calls are routed); `entry(index)` is each replica's body."""
    if spawn is None:
        import torch_xla.distributed.xla_multiprocessing as xmp

        spawn = xmp.spawn

    def stop_replicas(signum, frame):
        # Replicas may not have seen the signal (e.g. `kill -INT <launcher>`);
        # terminate them so the pool's shutdown cannot wait on them forever.
        for child in multiprocessing.active_children():
            child.terminate()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop_replicas)
    signal.signal(signal.SIGTERM, stop_replicas)
    try:
        spawn(entry, args=(), nprocs=None, start_method=start_method)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # BrokenProcessPool and anything re-raised by the pool
        log(f"a replica failed ({type(exc).__name__}); its message is above. "
            "The other replicas were stopped.")
        return EXIT_FAILED
    return 0


def run_self_starting(script: str, args: tuple[str, ...], plan: LaunchPlan) -> int:
    """Run `script` as `python script.py args` would, its xmp.spawn / torch_xla.launch routed to
    `plan`: torch_xla's own spawn, one process per chip (plan.spawn), else `fn(0, *args)` here.
    torch_xla's `nprocs=1` path also calls `fn(0, *args)` in the calling process."""
    from xla_fsdp.runtime import self_starting

    original = []  # torch_xla's own spawn, set when the hooks are in
    started: list[str] = []  # the entry points the script called, so a failure names replica 0

    def start(caller, fn, fn_args, nprocs, start_method):
        self_starting.nprocs_asked(caller, nprocs, plan.num_cores)
        self_starting.check_callable(fn, fn_args, caller)
        started.append(caller)
        if plan.spawn:
            log(f"{caller}: spawning {plan.num_cores} replicas of {self_starting.describe(fn)} "
                "(one process per chip)")
            code = run_spawned(self_starting.ReplicaCall(fn, fn_args), spawn=original[0],
                               start_method=start_method)
            if code:
                raise SystemExit(code)
            return None
        return fn(0, *fn_args)

    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script.py` does
    try:
        with self_starting.hooked_entry_points(start) as spawn:
            original.append(spawn)
            runpy.run_path(script, run_name="__main__")
    except self_starting.Refused as e:
        raise UsageError(f"{script}: {e}") from None
    except SystemExit as exc:
        return exit_code(exc)
    except Exception:
        what = "replica 0" if started and not plan.spawn else script
        log(f"{what} failed:\n{traceback.format_exc()}")
        return EXIT_FAILED
    return 0


def describe_start(script: str, calls: tuple[str, ...], plan: LaunchPlan) -> str:
    """The one line that says how a self-starting script's own entry point will run."""
    if plan.spawn:
        how = f"one process per chip ({plan.num_cores}), each calling fn(index, *args), world {plan.num_cores}"
    elif plan.env.get(RUNTIME_ENV) == SINGLE_CONTROLLER:
        how = "fn(0, *args) once, in this process (the single controller)"
    else:
        how = "fn(0, *args) in this process on one device, world 1 (torch_xla's nprocs=1)"
    return (f"{script} starts itself: running its __main__ with its own arguments; its "
            f"{' or '.join(sorted(calls, reverse=True))}(fn, args=...) runs {how}")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_xla_logs()
    parser = build_parser()
    launcher_argv, script, script_args = split_argv(argv)
    options = parser.parse_args(launcher_argv)
    if script is None:
        parser.error("the training script path is missing (e.g. launch/run_clm.py)")
    try:
        if not Path(script).is_file():
            raise UsageError(f"training script not found: {script} "
                             f"(working directory: {os.getcwd()})")
        device, source = detect_device(os.environ)
        log(f"PJRT_DEVICE={device} ({source})")
        spmd, why = choose_spmd(options, script, device, os.environ)
        counts = device_counts(device, spmd, os.environ)
        num_cores = parse_num_cores(options.num_cores, counts, spmd)
        if num_cores > 1 and not spmd and per_chip_asked(options, os.environ):
            refuse_single_controller_only(script, device)
        if device == "CPU" and num_cores > 1 and not spmd:
            spmd, why = cpu_replicas(options, script, num_cores, os.environ)
        if why:
            log(why)
        plan = make_plan(device, num_cores, spmd)
        if plan.reason:
            log(plan.reason)
        os.environ.update(plan.env)
        if device == "TPU":
            if spmd:  # the libtpu budget depends on it ([Note: rings by default on a TPU])
                chips = slice_chips(counts.default)
                if chips:
                    os.environ.setdefault("XLA_FSDP_SLICE_CHIPS", str(chips))
            async_collective_flags()
        from xla_fsdp.runtime.self_starting import entry_calls

        calls = entry_calls(script)
        if spmd:
            from xla_fsdp.runtime.choice import enter_single_controller

            enter_single_controller()
        if calls:
            log(describe_start(script, calls, plan))
            return run_self_starting(script, tuple(script_args), plan)
        entry = ScriptEntry(script, tuple(script_args))
        if not plan.spawn and not defines_entry_point(script) and (spmd or declares_single_controller(script)):
            if not spmd:  # one device, as the script's own process group would set it up
                from xla_fsdp.runtime.choice import enter_single_controller

                enter_single_controller()
            log(f"{script} defines no {ENTRY_POINT}(index): it runs once as __main__ (single controller)")
            return run_as_main(entry)
        try:
            fn = entry.load()  # also checks _mp_fn early, before any spawn
        except UsageError:
            raise
        except SystemExit as exc:
            return exit_code(exc)
        except Exception:
            log(f"importing {script} failed:\n{traceback.format_exc()}")
            return EXIT_FAILED
        if plan.spawn:
            log(f"spawning {num_cores} replicas (one process per chip)")
            return run_spawned(entry)
        return run_in_process(fn)
    except UsageError as exc:
        log(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        log("interrupted; all replicas stopped")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
