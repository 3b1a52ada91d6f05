"""Every environment variable xla_fsdp reads, named and read here only.

Other modules import the names below and ask `get` (or one of the typed readers) for a value; no other module spells an
`XLA_FSDP_*` name or reads `XLA_FSDP_RUNTIME` / `XLA_USE_SPMD` (tests/test_environment.py holds both). `VARIABLES` is
the table docs/environment.md shows: who sets each variable and what it means; those marked internal only pass a fact
between xla_fsdp's own processes, and a user never sets them.

This module imports nothing but the standard library: the launcher reads it before torch."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional

# -- xla_fsdp's own -----------------------------------------------------------------------------
RUNTIME = "XLA_FSDP_RUNTIME"
SCRIPT_MARKER = "XLA_FSDP_TPU_RUNTIME"  # a module-level line in a script, not a variable (runtime/choice.py)
RINGS = "XLA_FSDP_RINGS"
TORUS = "XLA_FSDP_TORUS"
HOST_TIMEOUT = "XLA_FSDP_HOST_TIMEOUT"
COMPILE_CACHE = "XLA_FSDP_COMPILE_CACHE"
MALLOC = "XLA_FSDP_MALLOC"
VIRTUAL_HOSTS = "XLA_FSDP_VIRTUAL_HOSTS"
VIRTUAL_HOST_INDEX = "XLA_FSDP_VIRTUAL_HOST_INDEX"
FIT_MEMORY = "XLA_FSDP_FIT_MEMORY"
AOT = "XLA_FSDP_AOT"
INTERNAL = "XLA_FSDP_INTERNAL"

# -- torch_xla's, the platform's and other libraries' ---------------------------------------------
PJRT_DEVICE = "PJRT_DEVICE"
CPU_NUM_DEVICES = "CPU_NUM_DEVICES"
TORCH_XLA_SPMD = "XLA_USE_SPMD"
TORCH_XLA_CACHE = "XLA_PERSISTENT_CACHE_PATH"
LIBTPU_INIT_ARGS = "LIBTPU_INIT_ARGS"
TPU_LIBRARY_PATH = "TPU_LIBRARY_PATH"
TPU_LOG_DIR = "TPU_LOG_DIR"
TPU_ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"
TPU_WORKER_IDS = ("TPU_WORKER_ID", "CLOUD_TPU_TASK_ID")
NUM_SLICES = "MEGASCALE_NUM_SLICES"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
LD_PRELOAD = "LD_PRELOAD"
STORAGE_EMULATOR_HOST = "STORAGE_EMULATOR_HOST"

SINGLE_CONTROLLER = "single_controller"
MULTI_PROCESS = "multi_process"
RUNTIMES = (SINGLE_CONTROLLER, MULTI_PROCESS)


@dataclass(frozen=True)
class Variable:
    name: str
    set_by: str
    meaning: str
    internal: bool = False  # passes a fact between xla_fsdp's own processes


VARIABLES = (
    Variable(RUNTIME, "the launcher (a user may)",
             "`single_controller` (one process per host drives every local device) or `multi_process` "
             "(one per chip); as `--spmd` / `--per_chip` choose"),
    Variable(SCRIPT_MARKER, "a script's own line",
             "not a variable: `XLA_FSDP_TPU_RUNTIME = \"single_controller\"` at the top of a script declares "
             "the runtime it is built for"),
    Variable(RINGS, "a user", "`0`: keep all-gathers and staged reduce-scatters where the single controller "
             "would build rings of collective-permutes (models at the edge of HBM)"),
    Variable(TORUS, "the check (a user may)", "the slice's shape, `2x2x4` or `16x16`, where the runtime "
             "does not give device coordinates"),
    Variable(HOST_TIMEOUT, "a user", "seconds a host may stay silent before it is named lost (default 300)"),
    Variable(COMPILE_CACHE, "a user", "a folder for compiled programs (run_clm's `--compile_cache` wins)"),
    Variable(MALLOC, "a user", "`auto` (default: jemalloc or tcmalloc when found), `system` (glibc's) or "
             "the path of a malloc library the launcher preloads"),
    Variable(VIRTUAL_HOSTS, "tests (a user may)", "split one machine's devices into N hosts (a pod's code "
             "path on one machine)"),
    Variable(VIRTUAL_HOST_INDEX, "tests (a user may)", "this process's host, 0..N-1, with the variable above"),
    Variable(FIT_MEMORY, "the check (a user may)", "JSON `{\"peak\": bytes, \"limit\": bytes}`: the "
             "device memory `checkpoint_all_but_last: \"fit\"` plans with, where the device gives none"),
    Variable(AOT, "the check", "JSON settings of the ahead-of-time check's traced process: `trace`, "
             "`out`, `steps`, `dump`, `world`, `fit_report`; a user may give `poll_s` and "
             "`rank_0_alone` to the check itself", True),
    Variable(INTERNAL, "the launcher, xla_fsdp's import", "JSON facts for xla_fsdp's own child processes: "
             "the malloc library the process was started with (`malloc`), the LIBTPU_INIT_ARGS xla_fsdp set "
             "itself (`libtpu_set`) and the slice's chips (`chips`)", True),
    Variable(PJRT_DEVICE, "a user", "torch_xla's device: `TPU` or `CPU` (detected when unset)"),
    Variable(CPU_NUM_DEVICES, "a user", "torch_xla's number of XLA:CPU devices"),
    Variable(TORCH_XLA_SPMD, "a user", "torch_xla's SPMD mode, read as torch_xla 2.9 reads it (`true` or a "
             "positive integer): on, it chooses the single controller"),
    Variable(TORCH_XLA_CACHE, "torch_xla", "torch_xla's persistent compile cache, as xla_fsdp enabled it"),
    Variable(LIBTPU_INIT_ARGS, "a user (else the launcher)", "libtpu's flags; set by a user, kept as they are"),
    Variable(TPU_LIBRARY_PATH, "a user", "libtpu.so for the check (default: the libtpu package's)"),
    Variable(TPU_LOG_DIR, "a user (else the check)", "where libtpu writes its log"),
    Variable(TPU_ACCELERATOR_TYPE, "the TPU VM", "the slice, e.g. `v4-32`"),
    Variable("TPU_WORKER_ID", "the TPU VM", "this host's index in a pod slice"),
    Variable("CLOUD_TPU_TASK_ID", "the TPU VM", "this host's index (older images)"),
    Variable(NUM_SLICES, "Cloud TPU Multislice (tests on CPU)", "how many slices the job spans, joined over the "
             "data-center network: parameters are sharded within a slice and replicated across slices "
             "(runtime/slices.py); on XLA:CPU it splits the devices into that many virtual slices"),
    Variable(MASTER_ADDR, "a user", "where virtual hosts' process group meets (default 127.0.0.1)"),
    Variable(MASTER_PORT, "a user", "the port of that meeting, and of torch_xla's `xla://` store"),
    Variable(LD_PRELOAD, "a user (else the launcher)", "a user's preload: the launcher then preloads no malloc"),
    Variable(STORAGE_EMULATOR_HOST, "a user", "a GCS emulator for `gs://` paths (tests)"),
)


# variables that chose something once and no longer do: set, they are refused with what to do instead
REMOVED = {"XLA_FSDP_ENGINE": "the engine is the fsdp_config's choice: set \"xla_fsdp_v2\": true for the GSPMD engine",}


def refuse_removed(environ: Mapping[str, str] = os.environ) -> None:
    """A ValueError naming a REMOVED variable that is set, and what replaces it."""
    for name, instead in REMOVED.items():
        if get(name, environ):
            raise ValueError(f"{name} is no longer read: {instead}, and unset {name}")


def get(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The variable's value, stripped; "" when unset."""
    return environ.get(name, "").strip()


def raw(name: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The variable's value as set (None when unset), for code that restores it after."""
    return environ.get(name)


def torch_xla_flag(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """A boolean variable of torch_xla's, read as torch_xla 2.9 reads it (`check_env_flag` in torch_xla/utils/utils.py:
    exactly "true", or a positive integer), so that xla_fsdp and torch_xla never disagree on whether SPMD is on."""
    value = environ.get(name, "")
    return value == "true" or (value.isdigit() and int(value) > 0)


def runtime(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The runtime the environment asks for: XLA_FSDP_RUNTIME, else torch_xla's XLA_USE_SPMD (true: the single
    controller), else None. A value that is neither runtime is refused."""
    asked = get(RUNTIME, environ).lower()
    if asked:
        if asked not in RUNTIMES:
            raise ValueError(f"{RUNTIME}={asked!r}: expected {SINGLE_CONTROLLER!r} or {MULTI_PROCESS!r} (or unset)")
        return asked
    return SINGLE_CONTROLLER if torch_xla_flag(TORCH_XLA_SPMD, environ) else None


def json_value(name: str, environ: Mapping[str, str] = os.environ) -> dict:
    """A JSON object held in a variable ({} when unset)."""
    text = get(name, environ)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={text!r}: expected a JSON object")
    return value


def aot(environ: Mapping[str, str] = os.environ) -> dict:
    """The check's settings (AOT); "1" alone (as tests set it) means {"trace": true}."""
    if get(AOT, environ) in ("1", "0"):
        return {"trace": get(AOT, environ) == "1"}
    return json_value(AOT, environ)


def _updated(current: dict, updates: dict) -> str:
    """`current` with `updates` (None removes a key), as a variable's JSON value."""
    merged = {**current, **updates}
    return json.dumps({k: v for k, v in merged.items() if v is not None}, sort_keys=True)


def with_aot(environ: Mapping[str, str], **settings) -> str:
    """AOT's value with `settings` added to what `environ` holds (None removes a key)."""
    return _updated(aot(environ), settings)


def internal(environ: Mapping[str, str] = os.environ) -> dict:
    """The facts xla_fsdp's own processes passed down (INTERNAL)."""
    return json_value(INTERNAL, environ)


def with_internal(environ: Mapping[str, str], **facts) -> str:
    """INTERNAL's value with `facts` added to what `environ` holds (None removes a key)."""
    return _updated(internal(environ), facts)


def num_slices(environ: Mapping[str, str] = os.environ) -> int:
    """How many slices the job spans (NUM_SLICES; 1 when unset). Anything but a positive integer is refused by name."""
    text = get(NUM_SLICES, environ)
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{NUM_SLICES}={text!r}: expected a positive integer (the number of slices), or unset")
    return int(text)


def host_index_before_start(environ: Mapping[str, str] = os.environ) -> int:
    """This host's index before the XLA runtime starts: a virtual host's, else a pod's."""
    for name in (VIRTUAL_HOST_INDEX, *TPU_WORKER_IDS):
        value = get(name, environ)
        if value.isdigit():
            return int(value)
    return 0
