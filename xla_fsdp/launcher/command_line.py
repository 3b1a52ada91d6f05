"""xla_spawn's command line: its flags, how a command splits into them, the script and the script's own arguments; its
exit codes and how it reports (one line on stderr, `xla_spawn: ...`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from xla_fsdp.runtime.environment import RUNTIME as RUNTIME_ENV  # noqa: F401 (the launcher's modules import it here)
from xla_fsdp.runtime.environment import SCRIPT_MARKER as RUNTIME_MARKER
from xla_fsdp.runtime.environment import SINGLE_CONTROLLER

PROG = "xla_spawn"
# CPU devices are virtual, so any count works; the cap only catches typos (e.g. 400 for 4) before they build hundreds of
# device threads.
CPU_MAX_DEVICES = 64
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ENTRY_POINT = "_mp_fn"
QUIET_XLA_LOG_LEVEL = "2"  # TensorFlow's convention: 2 hides INFO and WARNING, keeps ERROR
# Variables the TPU VM image or a pod's runtime sets; any one means "on a TPU".
TPU_ENV_HINTS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_BOUNDS",
                 "TPU_SKIP_MDS_QUERY")


class UsageError(Exception):
    """A mistake in the command line: reported as one message, exit 2."""


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def split_argv(argv: list[str]) -> tuple[list[str], Optional[str], list[str]]:
    """Split ``argv`` into launcher flags, the script path and the script's args.

    The script path is the first token that is neither a flag nor the value of ``--num_cores``; nothing after it is
    looked at, so a script flag that shares a launcher flag's name is never taken by the launcher."""
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
        prog=f"{PROG}.py", usage="%(prog)s [--num_cores N] [--spmd | --per_chip] SCRIPT [SCRIPT_ARGS ...]",
        description="Run SCRIPT's _mp_fn(index), or the xmp.spawn / torch_xla.launch call of a script that starts "
                    "itself, on XLA devices. Everything after SCRIPT is passed to it untouched.",
        epilog=f"On CPU, --num_cores takes 1..{CPU_MAX_DEVICES}; N>1 runs only as one process driving the N devices "
               f"(--spmd, or a script that declares {RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\"), where the script "
               "sees world 1; one process per CPU device would hang on explicit collectives. On TPU it takes 1 or "
               "every local device. On a multi-host pod run the same command on every worker.")
    parser.add_argument("--num_cores", default=None, metavar="N",
                        help="number of XLA devices (replicas) on this host; default: every local device (on CPU: "
                             "$CPU_NUM_DEVICES, else 1)")
    parser.add_argument("--spmd", action="store_true",
                        help="one process per host driving every local device (torch_xla's SPMD runtime, turned on "
                             "before the script runs; the single-controller runtime of the collective engine, or the "
                             f"GSPMD engine): sets {RUNTIME_ENV}={SINGLE_CONTROLLER} and runs one replica, index 0, "
                             "which sees xr.world_size() == 1 and feeds the global batch")
    parser.add_argument("--per_chip", action="store_true",
                        help="one process per chip (torch_xla's xmp.spawn; pinned collectives), also for a script "
                             f"that declares {RUNTIME_MARKER} = \"{SINGLE_CONTROLLER}\" (launch/run_clm.py does); a "
                             "script that declares nothing runs this way on a TPU by default. TPU only at "
                             "--num_cores > 1")
    return parser
