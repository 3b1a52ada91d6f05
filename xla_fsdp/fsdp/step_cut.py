"""The graph cut of a training step, for FSDP2 loops written for GPUs (no `torch_xla.sync()`).

[Note: the step cut] torch_xla traces lazily: nothing runs until something cuts the graph, which XLA training loops do
once per step with `torch_xla.sync()` (or `xm.mark_step()`). A loop written for GPUs has no such line, so its pending
graph grows by one step per iteration: each step compiles a longer program, and reading a parameter after N steps
compiles N steps for it alone. So when an optimizer steps over `fully_shard` parameters and nothing cut the graph since
the previous step, the step is cut right after `optimizer.step()` returns: one program per step, the same every step.

A loop that cuts by itself gets no cut of ours: if torch_xla's count of graph cuts ("MarkStep", which
`torch_xla.sync()`, `xm.mark_step()` and `xm.optimizer_step(..., barrier=True)` advance and reading a value does not)
moved between two optimizer steps, the loop cuts. The first step gives no such evidence (a loop's own cut comes after
`optimizer.step()`), so the root module's next forward, or a state dict taken before it, cuts the first step if the loop
did not."""
from __future__ import annotations

from typing import Optional

COUNTER = "MarkStep"  # torch_xla's counter of graph cuts


class _Cuts:
    """Process-wide: one lazy graph per process, whoever's optimizer stepped."""

    after_last_step: Optional[int] = None  # the cut count right after the last step (and our cut)
    undecided = False  # the first step ran and nothing has shown whether the loop cuts
    hook = None


def install() -> None:
    """The optimizer-step post-hook (once per process); a `fully_shard` call installs it."""
    if _Cuts.hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _Cuts.hook = register_optimizer_step_post_hook(_after_step)


def cut_count() -> int:
    """torch_xla's count of graph cuts in this process."""
    import torch_xla.debug.metrics as met

    return int(met.counter_value(COUNTER) or 0)


def _steps_sharded_params(optimizer) -> bool:
    from ..collective_engine.sharded_param import ShardedParameter

    return any(isinstance(p, ShardedParameter) for g in optimizer.param_groups for p in g["params"])


def _cut() -> None:
    import torch_xla

    torch_xla.sync()  # through the module attribute: the TPU check intercepts it there


def _after_step(optimizer, args, kwargs) -> None:
    if not _steps_sharded_params(optimizer):
        return
    if _Cuts.after_last_step is None:  # the first step: decided by settle()
        _Cuts.after_last_step, _Cuts.undecided = cut_count(), True
        return
    _Cuts.undecided = False
    if cut_count() == _Cuts.after_last_step:
        _cut()
    _Cuts.after_last_step = cut_count()


def before_state_dict(module, prefix, keep_vars) -> None:
    """State-dict pre-hook of every fully_shard unit: a state dict reads every parameter, so the first step is settled
    first."""
    settle()


def settle() -> None:
    """Before the root's forward and before a state dict: cut the first step if the loop did not (see
    [Note: the step cut]). Cheap when there is nothing to decide."""
    if not _Cuts.undecided:
        return
    _Cuts.undecided = False
    if cut_count() == _Cuts.after_last_step:
        _cut()
        _Cuts.after_last_step = cut_count()
