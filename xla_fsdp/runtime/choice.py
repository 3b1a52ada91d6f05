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


def declared_runtime(script: str) -> Optional[str]:
    """The runtime `script` declares with `XLA_FSDP_TPU_RUNTIME = "..."`, else None."""
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return None  # running it will say what is wrong
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
        return SINGLE_CONTROLLER, (f"{script} declares {MARKER} = \"{SINGLE_CONTROLLER}\": one process "
                                   "per host drives every local chip (unpinned collectives, which libtpu "
                                   "overlaps with compute); --per_chip runs one process per chip")
    return MULTI_PROCESS, ""
