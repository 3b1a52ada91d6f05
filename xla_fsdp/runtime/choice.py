"""Which runtime a script runs in on a TPU when its command does not say.

A script declares the runtime it is built for with one module-level line (<SCRIPT_MARKER>: `environment.SCRIPT_MARKER`,
spelled out in docs/environment.md),

    <SCRIPT_MARKER> = "single_controller"    # or "multi_process"

read here from the file's syntax tree (the script is not imported). Three kinds of script declare the single controller
without the line, because they cannot run any other way: one that imports the Trainer integration
(`xla_fsdp.integrations.transformers`), one that imports FSDP2's API (`xla_fsdp.fsdp`), and one that starts its process
group as the README's FSDP2 port does (`init_process_group("gloo", init_method="xla://")`). The launcher
(`launch/xla_spawn.py`) and the ahead-of-time check (`python -m xla_fsdp.aot`) use it when neither `--spmd` /
`--per_chip` nor the runtime variable (`environment.RUNTIME`) chose. A script that declares nothing runs one process per
chip, the contract of torch_xla's `xmp.spawn` that scripts written for torch_xla's FSDP rely on (`xm.get_ordinal()` per
process, pinned collectives). `launch/run_clm.py` declares the single controller: on a TPU its collectives are unpinned,
so libtpu can run them asynchronously beside compute, which it never does for pinned ones (docs/performance.md, "Only
unpinned collectives overlap").

On CPU the launcher reads the same declaration at `--num_cores N > 1`, where only the single controller runs: a script
that declares it runs there (it sees world 1), any other is refused ([Note: no silent world on CPU] in
`xla_fsdp/launcher/single_controller.py`)."""
from __future__ import annotations

import ast
import os
from typing import Mapping, Optional, Tuple

from . import environment
from .environment import MULTI_PROCESS, SINGLE_CONTROLLER, TORCH_XLA_SPMD
from .environment import SCRIPT_MARKER as MARKER


TRAINER_INTEGRATION = "xla_fsdp.integrations.transformers"
FSDP2_API = "xla_fsdp.fsdp"
XLA_INIT_METHOD = "xla://"
# torch_xla warns when use_spmd() finds its SPMD variable set: enter_single_controller's use_spmd() set it, so a script
# (or run_clm) that turns SPMD on itself would print a deprecation it cannot act on
SPMD_ENV_DEPRECATION = f"{TORCH_XLA_SPMD} is being deprecated"


def enter_single_controller() -> None:
    """torch_xla's SPMD mode, before a script creates any XLA tensor: the script need not call xr.use_spmd() itself, and
    xla_fsdp's engine (which asks xr.is_spmd()) drives every device. The launcher calls it for the single controller,
    and so does the ahead-of-time check's traced process, so a script is traced exactly as it runs. It also sets
    torchrun's per-host variables that GPU scripts read (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`) unless set: this process is
    the only one of its host, local rank 0 (rank and world size come from the process group)."""
    import os
    import warnings

    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")

    import torch_xla.runtime as xr

    warnings.filterwarnings("ignore", message=SPMD_ENV_DEPRECATION)
    if not xr.is_spmd():
        xr.use_spmd()


def check_spmd_came_first(who: str) -> None:
    """A RuntimeError, from `who`, unless the SPMD runtime is on and was turned on before the first XLA tensor
    ([Note: use_spmd after the device]).

    [Note: use_spmd after the device] torch_xla 2.9's `xr.use_spmd()` called after the script touched the XLA device (a
    `model.to(device)` above it) only warns, and the program then dies in its first sync without a word (XLA:CPU: a
    segmentation fault; torch_xla's own FSDPv2 class alike). What tells it apart: the default device's real device is
    then the first chip (`CPU:0`, `TPU:0`) instead of SPMD's virtual device (`SPMD:0`)."""
    import torch_xla
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        raise RuntimeError(f"{who} needs the SPMD runtime: call torch_xla.runtime.use_spmd() before any XLA "
                           "tensor is created (torch_xla's FSDPv2 examples do it first thing)")
    real = torch_xla._XLAC._xla_real_devices([str(torch_xla.device())])[0]
    if not real.startswith("SPMD:"):
        raise RuntimeError(
            f"{who}: torch_xla.runtime.use_spmd() was called after this process had used the XLA device "
            f"({real}, not SPMD's virtual device), and such a program dies in its first step. Move the "
            "xr.use_spmd() call to the top of the script, before anything is placed on the device "
            "(model.to(device), torch_xla.device() tensors, a data loader's device)")


def declared_runtime(script: str) -> Optional[str]:
    """The runtime `script` declares with `<SCRIPT_MARKER> = "..."`, else the single controller for a script that can
    run no other way (`_single_controller_reason`), else None."""
    try:
        tree = parse_script(script)
    except (OSError, SyntaxError, ValueError):
        return None  # running it will say what is wrong
    declared = _marker(script, tree)
    return SINGLE_CONTROLLER if declared is None and _single_controller_reason(tree) else declared


def _single_controller_reason(tree: ast.Module) -> str:
    """Why a script with no marker is a single-controller script ("" when it is not): it imports the Trainer
    integration anywhere (the two lines a Hugging Face example gets: a Trainer runs as one process whose engine shards
    over the host's devices; `--per_chip` still picks one process per chip), or FSDP2's API, or starts its process group
    through `xla://` with a CPU backend (the README's FSDP2 port). torch_xla's per-chip scripts start theirs with the
    "xla" backend, which is not taken as a declaration."""
    if imports_module(tree, TRAINER_INTEGRATION):
        return f"imports {TRAINER_INTEGRATION} (a Trainer runs as one process per host)"
    if imports_module(tree, FSDP2_API):
        return (f"imports {FSDP2_API} (FSDP2's fully_shard runs on the single controller; one process "
                "per chip is refused)")
    if inits_xla_process_group(tree):
        return (f"starts its process group with init_method=\"{XLA_INIT_METHOD}\" and a CPU backend "
                "(FSDP2's rank semantics: one rank per host)")
    return ""


def imports_module(tree: ast.Module, name: str) -> bool:
    """Whether the script imports `name` or anything inside it, in any form (`import a.b`, `import a.b.c as x`,
    `from a.b import x`, `from a import b`)."""
    parent, _, leaf = name.rpartition(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == name or a.name.startswith(name + ".") for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == name or node.module.startswith(name + "."):
                return True
            if parent and node.module == parent and any(a.name == leaf for a in node.names):
                return True
    return False


def inits_xla_process_group(tree: ast.Module) -> bool:
    """Whether the script calls `init_process_group(backend, init_method="xla://")` with a backend other than "xla"
    (positional or keyword arguments)."""
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "init_process_group":
            continue
        args, kwargs = dict(enumerate(node.args)), {k.arg: k.value for k in node.keywords if k.arg}
        method, backend = kwargs.get("init_method", args.get(1)), kwargs.get("backend", args.get(0))
        # the "xla" backend is torch_xla's per-process one: one process per chip
        if isinstance(method, ast.Constant) and method.value == XLA_INIT_METHOD and not (
                isinstance(backend, ast.Constant) and backend.value == "xla"):
            return True
    return False


def _marker(script: str, tree: ast.Module) -> Optional[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == MARKER for t in node.targets):
            value = node.value.value if isinstance(node.value, ast.Constant) else None
            if value not in (SINGLE_CONTROLLER, MULTI_PROCESS):
                raise ValueError(f"{script}: {MARKER} = {value!r}; expected {SINGLE_CONTROLLER!r} or {MULTI_PROCESS!r}")
            return value
    return None


def decide(spmd_flag: bool, per_chip: bool, script: str, on_tpu: bool,
           environ: Mapping[str, str] = os.environ) -> Tuple[Optional[str], str]:
    """The one decision of the runtime, which the launcher and the check ask (the job and the Trainer integration then
    read what the launcher exported: `environment.runtime`). In order: `--spmd` / `--per_chip`; the environment (ours,
    then torch_xla's SPMD switch); on a TPU (and for the check, which decides as on one) what the script declares, else
    one process per chip. Returns (runtime, why) with `why` a line for the user where the choice is not the obvious one,
    and runtime None off a TPU when nothing chose (the launcher's CPU rules decide then). Raises ValueError for
    contradicting flags, a bad variable or a bad declaration."""
    if spmd_flag and per_chip:
        raise ValueError("--spmd and --per_chip contradict each other; pass one")
    if spmd_flag or per_chip:
        return (SINGLE_CONTROLLER if spmd_flag else MULTI_PROCESS), ""
    asked = environment.runtime(environ)
    if asked:  # torch_xla's switch alone: its is_spmd() reads it, the script runs in SPMD mode whatever is planned
        return asked, ("" if environment.get(environment.RUNTIME, environ) else
                       f"{TORCH_XLA_SPMD}=1 in the environment: torch_xla's SPMD mode, the single controller")
    if not on_tpu:
        return None, ""
    if not script:
        return MULTI_PROCESS, ""
    return tpu_default(script)


def tpu_default(script: str) -> Tuple[str, str]:
    """(runtime, why) for `script` on a TPU slice when nothing else chose: what the script declares, else one process
    per chip; `why` is empty when the script declared nothing. Raises ValueError for a declaration that names no
    runtime."""
    declared = declared_runtime(script)
    if declared == SINGLE_CONTROLLER:
        tree = parse_script(script)
        what = (f"declares {MARKER} = \"{SINGLE_CONTROLLER}\"" if _marker(script, tree) is not None
                else _single_controller_reason(tree))
        return SINGLE_CONTROLLER, (f"{script} {what}: one process per host drives every local chip "
                                   "(unpinned collectives, which libtpu overlaps with compute); --per_chip "
                                   "runs one process per chip")
    return MULTI_PROCESS, ""


def parse_script(script: str) -> ast.Module:
    """The script's syntax tree (raises OSError, SyntaxError or ValueError)."""
    with open(script, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=script)
