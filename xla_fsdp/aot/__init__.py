"""Check a training job for a Cloud TPU slice before renting it (ahead-of-time compile).

    python -m xla_fsdp.aot --tpu v4-8 -- launch/run_clm.py <the job's flags>

traces two steps of the job on this host at the slice's device count, in the runtime it would use there (nothing
executes: [Note: abstract tracing]), compiles the second step with libtpu's own compiler for the slice's topology, and
reports whether it compiles, its HBM per chip against the chip's, and the collectives of the TPU-optimized program. For
a training loop of your own, either run its script under the check as it is (each step must end in `torch_xla.sync()` or
`xm.mark_step()`, and the first step must not read values back: see `--steps`), or mark the step:

    import xla_fsdp.aot

    def train_step():               # forward, backward, optimizer step; no sync needed
        ...

    if xla_fsdp.aot.tracing():      # only under `python -m xla_fsdp.aot`
        xla_fsdp.aot.check(train_step)   # never returns there
"""
from __future__ import annotations

from typing import Callable

from xla_fsdp.abstract import active as tracing

__all__ = ["check", "tracing"]


def check(step_fn: Callable[[], object]) -> None:
    """Hand one training step to the ahead-of-time check: `step_fn()` runs as many times as the check's `--steps`
    says (default 2), each followed by a graph cut; the last one is compiled for the TPU and the process ends. Only
    under `python -m xla_fsdp.aot --tpu TYPE -- script.py`."""
    if not tracing():
        raise RuntimeError("xla_fsdp.aot.check() runs under the ahead-of-time check only: "
                           "python -m xla_fsdp.aot --tpu v4-8 -- your_script.py [its flags]")
    from xla_fsdp.aot import capture

    while True:  # the last cut ends the process
        step_fn()
        capture.cut(force=True)
