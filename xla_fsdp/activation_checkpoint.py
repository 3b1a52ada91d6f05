"""Per-layer gradient checkpointing (`checkpoint_module`).

The forward of a checkpointed module runs without saving activations; its backward re-runs the forward and
back-propagates through the recomputation. On an FSDP unit the whole unit forward (gather, compute, free) is what is
recomputed, so the recomputation sees full parameters.

[Note: recompute barrier] XLA traces forward and backward into one graph, and common-subexpression elimination would
notice that the recomputation equals the forward and reuse the forward's activations, silently undoing the memory
saving. The recomputation therefore starts from inputs passed through an optimization barrier together with the incoming
gradients, which makes it a different computation that can only run once those gradients exist. The outputs a
policy kept ([Note: saved outputs]) pass through the same barrier: otherwise what the recomputation derives from them
alone (GPT-2's attention softmax from kept q/k/v) would merge with the forward's and live until backward, holding
more than the policy names (the 2B's sdpa then held 3 GiB of float32 scores a block).

[Note: parameters as checkpoint inputs] The checkpoint is an autograd Function whose forward runs without autograd, so
its output requires grad only if one of its inputs does. The parameters are read inside the run (an FSDP unit gathers
them there), so a module fed only data (a first layer: images, token ids) would return an output with no gradient
function, and its parameters would get no gradient (issue 41). The parameters that require grad are therefore extra
inputs of the Function; it returns None for them, since the recomputation's own backward delivers their gradients.

[Note: checkpoint all but the last] Recomputing a unit costs one more forward of it in backward; keeping its activations
costs HBM from its forward until its backward. The last units in forward order hold theirs for the shortest stretch:
their backward comes first. So the root's `checkpoint_all_but_last=N` lets the last N checkpointed units (module order,
which is forward order for a stack of layers) keep their activations, a memory-for-speed knob for slices whose HBM has
room. N=1 saves a block's recomputation for almost no HBM (the last block's activations replace its recomputation at the
same point of the program); each further block adds its activations to the peak (docs/performance.md, "Recomputing fewer
layers")."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .runtime.barrier import optimization_barrier
from .class_swap import mix_into, unmix
from .memory.fit import FitPlan, is_fit
from .memory import host_offload
from .memory.kept_bytes import saved_bytes
from .memory.remat_policy import given, note_applied, policy_named, policy_of, role_bytes, saved_modules, set_policy
from .memory.saved_outputs import capturing, substituting
from .recompute_context import ForwardState
from .unit_state import state_of

_local = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed forward is being re-run inside backward."""
    return getattr(_local, "depth", 0) > 0


class _CheckpointMixin:
    """Class mixed into a plain module by `checkpoint_module`."""

    def forward(self, *args, **kwargs):
        return checkpointed_call(super().forward, args, kwargs, self)


def checkpoint_module(module: nn.Module, remat_policy=None) -> nn.Module:
    """Checkpoint `module`'s forward; returns `module` itself (parameter names unchanged).

    Works before or after FSDP wrapping: `FSDP(checkpoint_module(layer))` (torch_xla's order) and
    `checkpoint_module(FSDP(layer))` both recompute the unit including its gather. `remat_policy`: what it saves for the
    backward ([Note: recomputation policies] in memory/remat_policy.py); default "full" (its input only), or the unit's
    own `remat_policy`."""
    set_policy(module, remat_policy)
    state = state_of(module)
    if state is not None:  # a unit of the collective engine recomputes its own forward, gather included
        state.checkpointed = True
        return module
    enable = getattr(module, "enable_activation_checkpointing", None)
    if enable is not None:  # a unit of the GSPMD engine says what checkpointing means there
        enable()
        return module
    if isinstance(module, _CheckpointMixin):
        return module
    if type(module).forward is nn.Module.forward:
        raise ValueError(f"{type(module).__name__} has no forward() to checkpoint; checkpoint its children")
    return mix_into(module, _CheckpointMixin, "Checkpointed")


def strip_checkpoint(module: nn.Module) -> bool:
    """Undo `checkpoint_module`'s class change; returns whether it had been applied."""
    if isinstance(module, _CheckpointMixin):
        unmix(module)
        return True
    return False


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, spec, leaves, tensor_pos, module, out_holder, num_inputs, policy, *tensors):
        # tensors: the call's own, then the parameters ([Note: parameters as checkpoint inputs])
        inputs = tensors[:num_inputs]
        # tensors travel through save_for_backward only; keep the rest of the call's structure
        leaves = [None if i in set(tensor_pos) else x for i, x in enumerate(leaves)]
        ctx.run, ctx.spec, ctx.leaves, ctx.tensor_pos = run, spec, leaves, tensor_pos
        ctx.num_params = len(tensors) - num_inputs
        ctx.unit = module
        ctx.on_xla = any(t.device.type == "xla" for t in tensors)
        ctx.saves = saved_modules(module, policy)  # [Note: recomputation policies]
        ctx.offload = policy.offload
        with torch.no_grad():
            ctx.seen = ForwardState(module, ctx.on_xla)  # [Note: what a recomputation sees]
            args, kwargs = _rebuild(spec, leaves, tensor_pos, inputs)
            with capturing(ctx.saves) as kept:  # [Note: saved outputs]
                out = run(*args, **kwargs)
        ctx.num_inputs, ctx.input_grad = len(inputs), [t.requires_grad for t in inputs]
        stored = [*inputs, *kept]
        if ctx.offload:  # [Note: host offload]: the block's input (the first) and the saved outputs; the
            # other arguments (masks, rotary tables) are the same tensors for every block and stay
            with torch.no_grad():
                stored = [host_offload.to_host(t) if i == 0 or i >= len(inputs) else t for i, t in enumerate(stored)]
        ctx.save_for_backward(*stored)
        out_leaves, out_spec = tree_flatten(out)
        out_pos = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        out_holder.update(spec=out_spec, leaves=out_leaves, tensor_pos=out_pos)
        return tuple(out_leaves[i] for i in out_pos)

    @staticmethod
    def backward(ctx, *grads):
        saved = [t.detach() for t in ctx.saved_tensors]
        if ctx.offload:
            saved = [host_offload.to_device(t) if i == 0 or i >= ctx.num_inputs else t for i, t in enumerate(saved)]
        inputs, kept = saved[:ctx.num_inputs], saved[ctx.num_inputs:]
        if ctx.on_xla:  # [Note: recompute barrier], the kept outputs too
            live = [g for g in grads if g is not None]
            barred = optimization_barrier([*inputs, *kept, *live])
            inputs, kept = barred[:len(inputs)], barred[len(inputs):len(inputs) + len(kept)]
        inputs = [x.requires_grad_(wants) for x, wants in zip(inputs, ctx.input_grad)]
        _local.depth = getattr(_local, "depth", 0) + 1
        plan = getattr(state_of(ctx.unit), "fit_plan", None)  # [Note: keep what fits] measures here
        try:
            with ctx.seen.replayed(), torch.enable_grad(), _measured(plan, ctx.unit) as saved_bytes_now, \
                    substituting(ctx.saves, kept):
                args, kwargs = _rebuild(ctx.spec, ctx.leaves, ctx.tensor_pos, inputs)
                out = ctx.run(*args, **kwargs)
        finally:
            _local.depth -= 1
        if plan is not None:
            plan.record(ctx.unit, saved_bytes_now["bytes"], saved_bytes_now.get("roles"))
        out_leaves, _ = tree_flatten(out)
        outs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            # the parameters' gradients accumulate here, through the recomputation's own graph
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(x.grad if x.requires_grad else None for x in inputs)
        ctx.saves = None
        return (None,) * 8 + input_grads + (None,) * ctx.num_params


@contextlib.contextmanager
def _measured(plan, unit):
    if plan is None or plan.count is not None:
        yield {"bytes": 0}
        return
    with saved_bytes(unit) as got, role_bytes(unit) as roles:
        yield got
    got["roles"] = roles  # [Note: a policy per block] in memory/fit.py


def _rebuild(spec, leaves, tensor_pos, tensors):
    leaves = list(leaves)
    for pos, t in zip(tensor_pos, tensors):
        leaves[pos] = t
    return tree_unflatten(leaves, spec)


def _is_kv_cache(x) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)


def without_kv_cache(args, kwargs) -> Tuple[tuple, dict]:
    """The call's arguments with Hugging Face KV caches replaced by None and `use_cache` turned off.

    HF layers append to their KV cache in forward; a checkpoint's recomputation would append a second time and attend
    over doubled keys. HF's own gradient checkpointing drops the cache for the same reason; training never reads it.
    Used by both engines' checkpoint wrappers."""
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
    leaves, spec = tree_flatten((args, kwargs))
    if any(_is_kv_cache(x) for x in leaves):
        args, kwargs = tree_unflatten([None if _is_kv_cache(x) else x for x in leaves], spec)
    return tuple(args), dict(kwargs)


def checkpointed_call(run: Callable, args, kwargs, module: nn.Module) -> Any:
    """Call `run(*args, **kwargs)`, the forward of `module`, without keeping activations; recompute them in backward
    ([Note: what a recomputation sees])."""
    policy = policy_of(module)
    if not torch.is_grad_enabled():
        return run(*args, **kwargs)
    note_applied(module, policy)
    if policy.keeps_all:  # "none": the block keeps its activations
        return run(*args, **kwargs)
    args, kwargs = without_kv_cache(args, kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_pos]
    params = [p for p in module.parameters() if p.requires_grad]
    holder: Dict[str, Any] = {}
    outs = _Checkpoint.apply(run, spec, leaves, tensor_pos, module, holder, len(tensors), policy, *tensors, *params)
    return _rebuild(holder["spec"], holder["leaves"], holder["tensor_pos"], outs)


def checkpoint_all_but_last(root: nn.Module, units, count, agree=None) -> None:
    """[Note: checkpoint all but the last]: of the checkpointed units among `units` (the root's units in module order),
    the last `count` keep their activations and the others recompute; `count` "fit": as many as the device's memory
    holds ([Note: keep what fits] in memory/fit.py; `agree(n)`: the smallest n of every process). Called by the root
    before each forward, after foreign checkpoints are converted."""
    others = [u for u in units if u is not root]
    if not any(state_of(u).checkpointed for u in others) and any(given(u) for u in units):
        raise _nothing_checkpointed(f"remat_policy={policy_of(next(u for u in units if given(u))).name!r} says "
                                    "what checkpointed units save, and", "remat_policy")
    by_policy = policy_of(root).name == "fit"  # [Note: a policy per block] in memory/fit.py
    if by_policy:
        if count not in (0, None) and not is_fit(count):
            raise ValueError(f"remat_policy=\"fit\" chooses what each checkpointed unit keeps, and "
                             f"checkpoint_all_but_last={count!r} too; drop checkpoint_all_but_last")
        count = "fit"
    if is_fit(count):
        checkpointed = [u for u in others if state_of(u).checkpointed]
        count = _fitted(root, checkpointed, agree, by_policy)
        plan = state_of(root).fit_plan
        if by_policy and plan is not None and plan.assigned is not None:
            for u, name in zip(checkpointed, plan.assigned):
                set_policy(u, "full" if name == "none" else name)
                state_of(u).keeps_activations = name == "none"
                if name == "none" and torch.is_grad_enabled():
                    note_applied(u, policy_named("none"))
            return
        if not count:
            for u in others:
                state_of(u).keeps_activations = False
            return
    for u in others:
        mine = state_of(u).options.checkpoint_all_but_last
        if mine not in (0, count) and not is_fit(mine):
            raise ValueError(
                f"{type(u).__name__} was wrapped with checkpoint_all_but_last={mine} and its root with "
                f"{count}: which units recompute is the root's choice; give it to the root only")
    checkpointed = [u for u in others if state_of(u).checkpointed]
    if count and count >= len(checkpointed):
        if not checkpointed:
            raise _nothing_checkpointed(f"checkpoint_all_but_last={count}, but", "checkpoint_all_but_last")
        raise ValueError(f"checkpoint_all_but_last={count} would leave none of the {len(checkpointed)} "
                         f"checkpointed units recomputing: give at most {len(checkpointed) - 1}, or turn "
                         "activation checkpointing off")
    for i, u in enumerate(checkpointed):
        state_of(u).keeps_activations = i >= len(checkpointed) - count
        if state_of(u).keeps_activations and torch.is_grad_enabled():
            note_applied(u, None)  # for the check's report: kept by checkpoint_all_but_last


def _nothing_checkpointed(said: str, keyword: str) -> ValueError:
    """The error for `keyword`, which says what checkpointed units do, where no unit is checkpointed."""
    return ValueError(f"{said} no unit is checkpointed: turn on activation_checkpointing=True (xla_fsdp_grad_ckpt in "
                      f"a Hugging Face fsdp_config), or drop {keyword}")


def _fitted(root: nn.Module, checkpointed, agree, by_policy: bool = False) -> int:
    """The count "fit" gives for this forward; the units are measured until it is known."""
    if not checkpointed:
        what = "remat_policy" if by_policy else "checkpoint_all_but_last"
        raise _nothing_checkpointed(f"{what}=\"fit\", but", what)
    state = state_of(root)
    plan = getattr(state, "fit_plan", None)
    if plan is None:
        plan = state.fit_plan = FitPlan(agree, policies=by_policy)
    count = plan.resolve(checkpointed)
    for u in checkpointed:
        state_of(u).fit_plan = plan if plan.count is None else None
    return count
