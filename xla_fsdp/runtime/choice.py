"""Which runtime a script runs in on a TPU when its command does not say.

A script declares the runtime it is built for with one module-level line,

    XLA_FSDP_TPU_RUNTIME = "single_controller"    # or "multi_process"

read here from the file's syntax tree (the script is not imported). The
launcher (`launch/xla_spawn.py`) and the ahead-of-time check
(`python -m xla_fsdp.aot`) use it when neither `--spmd` / `--per_chip` nor
`XLA_FSDP_RUNTIME` chose, on one host or a pod slice (the single controller
checkpoints and reads data per host: xla_fsdp/checkpoint/host_shards.py,
xla_fsdp/runtime/hosts.py); a script that declares nothing runs one process
per chip, the contract of torch_xla's `xmp.spawn` that scripts written for
torch_xla's FSDP rely on (`xm.get_ordinal()` per process, pinned
collectives). `launch/run_clm.py` declares the single controller: on a TPU
its collectives are unpinned, so libtpu can run them asynchronously beside
compute, which it never does for pinned ones (docs/performance.md, "Only unpinned collectives
overlap").

On CPU the launcher reads the same declaration at `--num_cores N > 1`, where
only the single controller runs: a script that declares it runs there (it
sees world 1), any other is refused ([Note: no silent world on CPU] in
`launch/xla_spawn.py`).
"""
from __future__ import annotations

import ast
from typing import Optional, Tuple

MARKER = "XLA_FSDP_TPU_RUNTIME"
SINGLE_CONTROLLER = "single_controller"
MULTI_PROCESS = "multi_process"


TRAINER_INTEGRATION = "xla_fsdp.integrations.transformers"
# torch_xla warns when use_spmd() finds XLA_USE_SPMD set: enter_single_controller's use_spmd() set
# it, so a script (or run_clm) that turns SPMD on itself would print a deprecation it cannot act on
SPMD_ENV_DEPRECATION = "XLA_USE_SPMD is being deprecated"


def enter_single_controller() -> None:
    """torch_xla's SPMD mode, before a script creates any XLA tensor: the script need not call
    xr.use_spmd() itself, and xla_fsdp's engine (which asks xr.is_spmd()) drives every device.
    The launcher calls it for the single controller, and so does the ahead-of-time check's traced
    process, so a script is traced exactly as it runs."""
    import warnings

    import torch_xla.runtime as xr

    warnings.filterwarnings("ignore", message=SPMD_ENV_DEPRECATION)
    if not xr.is_spmd():
        xr.use_spmd()


def declared_runtime(script: str) -> Optional[str]:
    """The runtime `script` declares with `XLA_FSDP_TPU_RUNTIME = "..."`, else the single
    controller for a script that imports the Trainer integration (see `enables_trainer`),
    else None."""
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return None  # running it will say what is wrong
    declared = _marker(script, tree)
    if declared is None and enables_trainer(tree):
        return SINGLE_CONTROLLER
    return declared


def enables_trainer(tree: ast.Module) -> bool:
    """Whether the script imports xla_fsdp's Trainer integration anywhere (the two lines a Hugging
    Face example gets). A Trainer script runs as one process whose engine shards over the
    host's devices (the integration's contract), so importing it declares the single controller:
    on a TPU that is the runtime whose collectives libtpu overlaps with compute, and on CPU the
    only one that runs at several devices. `--per_chip` still picks one process per chip."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == TRAINER_INTEGRATION for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == TRAINER_INTEGRATION or (
                    node.module == "xla_fsdp.integrations" and any(a.name == "transformers" for a in node.names)):
                return True
    return False


def _marker(script: str, tree: ast.Module) -> Optional[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == MARKER for t in node.targets):
            value = node.value.value if isinstance(node.value, ast.Constant) else None
            if value not in (SINGLE_CONTROLLER, MULTI_PROCESS):
                raise ValueError(f"{script}: {MARKER} = {value!r}; expected {SINGLE_CONTROLLER!r} or "
                                 f"{MULTI_PROCESS!r}")
            return value
    return None


def tpu_default(script: str) -> Tuple[str, str]:
    """(runtime, why) for `script` on a TPU slice when nothing else chose: what the script
    declares, else one process per chip; `why` is empty when the script declared nothing.
    Raises ValueError for a declaration that names no runtime."""
    declared = declared_runtime(script)
    if declared == SINGLE_CONTROLLER:
        what = (f"declares {MARKER} = \"{SINGLE_CONTROLLER}\"" if _declares_marker(script)
                else f"imports {TRAINER_INTEGRATION} (a Trainer runs as one process per host)")
        return SINGLE_CONTROLLER, (f"{script} {what}: one process per host drives every local chip "
                                   "(unpinned collectives, which libtpu overlaps with compute); --per_chip "
                                   "runs one process per chip")
    return MULTI_PROCESS, ""


def _declares_marker(script: str) -> bool:
    with open(script, encoding="utf-8") as f:
        return _marker(script, ast.parse(f.read(), filename=script)) is not None
