"""Launch a training script on XLA devices (PJRT runtime).

Usage (compatible with the Hugging Face / torch_xla ``xla_spawn.py``)::

    python launch/xla_spawn.py [--num_cores N] [--spmd | --per_chip] path/to/train.py --its --own --flags

Launcher flags come before the script path; everything after it reaches the
script untouched (even ``--num_cores`` or ``--help``). The script is imported
by path and its ``_mp_fn(index)`` is called once per replica with
``sys.argv == [script_path, *script_args]``.

What runs where:

============  ==============  ================================================
device        --num_cores     behaviour
============  ==============  ================================================
any           1               ``_mp_fn(0)`` in this process, no spawn
CPU           2..64           one process drives the N devices (single-controller
                              runtime): ``CPU_NUM_DEVICES=N``,
                              ``XLA_FSDP_RUNTIME=single_controller``
TPU           every local     ``xmp.spawn``: one process per chip, unless the
              device          script declares ``XLA_FSDP_TPU_RUNTIME =
                              "single_controller"`` (``launch/run_clm.py`` does):
                              then one process per host (below)
any + --spmd  (see --help)    one process per host (single-controller runtime),
                              ``_mp_fn(0)`` in this process
TPU + --per_chip              one process per chip whatever the script declares
============  ==============  ================================================

``XLA_FSDP_RUNTIME=single_controller`` / ``multi_process`` in the environment
chooses as ``--spmd`` / ``--per_chip`` do. On a TPU the launcher also sets
libtpu's async-collective flags in ``LIBTPU_INIT_ARGS`` unless you set it
(``xla_fsdp.tpu.libtpu_flags``).

The engine is the script's choice (``xla_fsdp_v2`` in the fsdp config, or
``XLA_FSDP_ENGINE=spmd``, selects the GSPMD engine; the collective engine runs
in either runtime). Why CPU never spawns several replicas: explicit XLA
collectives between processes (device threads, on CPU) race their compiles and
hang (pytorch/xla issues 5005 and 9089), while one process driving N virtual
devices runs the same collectives inside one SPMD program. The launcher says
so in one line when it makes that choice.

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
(bad ``--num_cores``, missing script, missing ``_mp_fn``) exit 2 without a
traceback.

``PJRT_DEVICE`` is detected when unset: TPU when TPU device files
(``/dev/accel*``, ``/dev/vfio/<n>``) or TPU environment variables are present,
else CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import multiprocessing
import os
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
        description="Run SCRIPT's _mp_fn(index) on XLA devices. Everything after "
                    "SCRIPT is passed to it untouched.",
        epilog=f"On CPU, --num_cores takes 1..{CPU_MAX_DEVICES} and N>1 runs one "
               "process driving the N devices (single-controller runtime; one "
               "process per CPU device would hang on explicit collectives). On TPU "
               "it takes 1 or every local device. On a multi-host pod run the same "
               "command on every worker.")
    parser.add_argument(
        "--num_cores", default=None, metavar="N",
        help="number of XLA devices (replicas) on this host; default: every "
             "local device (on CPU: $CPU_NUM_DEVICES, else 1)")
    parser.add_argument(
        "--spmd", action="store_true",
        help="one process per host driving every local device (torch_xla's SPMD "
             "runtime; the single-controller runtime of the collective engine, or "
             "the GSPMD engine): sets XLA_FSDP_RUNTIME=single_controller and calls "
             "_mp_fn(0) once")
    parser.add_argument(
        "--per_chip", action="store_true",
        help="one process per chip (torch_xla's xmp.spawn; pinned collectives), also for a "
             f"script that declares {RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\" (launch/run_clm.py does); "
             "a script that declares nothing runs this way on a TPU by default")
    return parser


def choose_spmd(options, script: str, device: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """(single controller?, why, when the script's declaration decided it). --spmd / --per_chip
    win; then XLA_FSDP_RUNTIME; then, on a TPU slice (one host or several), what the script
    declares (xla_fsdp.runtime.choice)."""
    if options.spmd and options.per_chip:
        raise UsageError("--spmd and --per_chip contradict each other; pass one")
    if options.spmd or options.per_chip:
        return options.spmd, ""
    if environ.get(RUNTIME_ENV, "").strip():
        return environ[RUNTIME_ENV].strip().lower() == SINGLE_CONTROLLER, ""
    if device != "TPU":
        return False, ""
    from xla_fsdp.runtime import choice as runtime_choice

    try:
        runtime, why = runtime_choice.tpu_default(script)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return runtime == SINGLE_CONTROLLER, why


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
        return LaunchPlan(device, num_cores, False, env)
    if device == "CPU" and num_cores > 1:
        env[RUNTIME_ENV] = SINGLE_CONTROLLER
        return LaunchPlan(device, num_cores, False, env, reason=(
            f"--num_cores {num_cores} on CPU: one process drives the {num_cores} devices "
            f"(single-controller runtime: {RUNTIME_ENV}={SINGLE_CONTROLLER}, "
            f"CPU_NUM_DEVICES={num_cores}) because explicit XLA collectives between "
            "one process per CPU device hang"))
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
                             f"add `def {ENTRY_POINT}(index): main()` to it")
        return fn

    def __call__(self, index: int) -> None:
        """Replica body in the spawn path: any failure ends this process now.

        Exiting with os._exit breaks the parent's process pool, which then
        terminates the other replicas instead of leaving them blocked in a
        collective that this replica will never join.
        """
        try:
            self.load()(index)
        except SystemExit as exc:
            if exit_code(exc) != 0:
                log(f"replica {index} exited with {exc.code}")
                os._exit(exit_code(exc))
        except KeyboardInterrupt:
            os._exit(EXIT_INTERRUPTED)
        except BaseException:
            log(f"replica {index} failed:\n{traceback.format_exc()}")
            os._exit(EXIT_FAILED)


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


def run_spawned(entry: ScriptEntry) -> int:
    import torch_xla.distributed.xla_multiprocessing as xmp

    def stop_replicas(signum, frame):
        # Replicas may not have seen the signal (e.g. `kill -INT <launcher>`);
        # terminate them so the pool's shutdown cannot wait on them forever.
        for child in multiprocessing.active_children():
            child.terminate()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop_replicas)
    signal.signal(signal.SIGTERM, stop_replicas)
    try:
        xmp.spawn(entry, args=(), nprocs=None)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # BrokenProcessPool and anything re-raised by the pool
        log(f"a replica failed ({type(exc).__name__}); its message is above. "
            "The other replicas were stopped.")
        return EXIT_FAILED
    return 0


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
        if why:
            log(why)
        counts = device_counts(device, spmd, os.environ)
        num_cores = parse_num_cores(options.num_cores, counts, spmd)
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
        entry = ScriptEntry(script, tuple(script_args))
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
