"""`FSDPState`: what a unit does around its module's forward and backward.

[Note: prefetch] XLA overlaps a collective with compute only when neither depends on the other. A unit's gather is tied
(optimization barrier) to its own input, which is the previous unit's output, so without prefetch nothing can run beside
it. The root records the order its units ran in; next step, unit k starts unit k+1's gather tied to *its own* input
(forward_prefetch), so it runs during unit k's compute, and no earlier: at most two units' full parameters are alive. In
backward, unit k's incoming gradient also starts the re-gather of the unit whose backward comes next (BACKWARD_PRE), or
unit k's reduced gradients do (BACKWARD_POST: less overlap, less memory). Early gathers are plain tensors wired into
autograd by the unit that uses them: a checkpointed unit's first forward runs without autograd and still prefetches, and
its recomputation takes the re-gather started for it (checked on the traced program: tests/test_overlap.py).

[Note: the first gather of a step] A unit whose own gather was not started early (the root, every step) would issue two
gathers tied to the same input: its own and the one it prefetches. For the root neither has a matmul before it, so both
could be hoisted to the start of the program, and the first has no work beside it. When both units gather as one flat
bucket (`flatten_parameters=True`), one collective serves both (`gather_together`): one launch less and one exposed
gather instead of two, for no extra copy. With the default buckets each large parameter is gathered in place, and
joining them would copy both units' parameters out of a flat buffer every step (measured: 6% step time on XLA:CPU), so
they gather separately, as do units whose collectives differ (groups, device, compute dtype). If the root computed much
before its first child (in decoders it only looks up embeddings), the joined gather could not overlap that.

[Note: a unit of several modules] FSDP2's `fully_shard([a, b])` makes one unit of several modules: one group, gathered
by one collective. The first of them to run its forward gathers the group and leaves it registered; the others compute
with it; after the last of them the unit frees it (or keeps it for backward) as a one-module unit does after its
forward. If a pass ends before all of them ran (the root's forward returns), the root frees it then. The backward is a
one-module unit's: the first incoming gradient of any of their outputs gathers again, and the reduce-scatter runs once
every gradient of the group has arrived. A recomputation (activation checkpointing) re-runs each module's forward.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from ..activation_checkpoint import checkpoint_all_but_last, is_recomputing
from ..options import FSDPOptions, ShardingStrategy, TrainingState
from ..forward_overrides import convert_checkpoint_after_wrapping, convert_checkpoint_wrappers_around_units
from .manual_region import ManualRegion
from .saved_params import active_units, make_hooks, registry
from .param_group import FSDPParamGroup, gather_together
from .precision import cast_inputs
from ..class_swap import original_class
from ..unit_state import state_of, units


class _Span:
    """A unit of several modules between its first module's forward and its last's: the gathered parameters stay
    registered ([Note: a unit of several modules])."""

    __slots__ = ("full", "reshard", "grad", "waiting")

    def __init__(self, full, reshard: bool, grad: bool, waiting: set):
        self.full, self.reshard, self.grad, self.waiting = full, reshard, grad, waiting


class FSDPState:
    """Hooks and bookkeeping of one FSDP unit."""

    def __init__(self, module: torch.nn.Module, group: FSDPParamGroup, options: FSDPOptions):
        self._module = weakref.ref(module)  # the module owns this state; no reference cycle
        self.modules = [self._module]  # the modules whose forwards gather (fully_shard([a, b]): several)
        self._span: Optional[_Span] = None
        self.group = group
        self.options = options
        self.is_root: Optional[bool] = None
        self.training_state = TrainingState.IDLE
        self._full_for_backward: Optional[List[torch.Tensor]] = None
        group.on_grads_reduced = self._after_grads_reduced
        self._units: Optional[List[torch.nn.Module]] = None  # the root's, once it has run
        self.unsharded: Optional[List[torch.Tensor]] = None  # full parameters while unshard()-ed
        # [Note: prefetch] the order units ran in during the root's last forward (root only),
        # each unit's neighbours in it, and gathers started early by a neighbour
        self._recording: Optional[List["FSDPState"]] = None
        self.next_forward: Optional["FSDPState"] = None
        self.next_backward: Optional["FSDPState"] = None
        self._prefetched: Optional[List[torch.Tensor]] = None
        # FSDP2's set_modules_to_forward_prefetch / _backward_prefetch: the units whose gathers this
        # one starts, in place of the recorded order (None: the recorded neighbour)
        self.forward_prefetch_targets: Optional[List["FSDPState"]] = None
        self.backward_prefetch_targets: Optional[List["FSDPState"]] = None
        # FSDP2's unshard(): a forward under autograd after it gathers as usual instead of refusing
        self.unshard_feeds_forward = False
        # what the front doors keep per unit ([Note: one engine state per unit])
        self.checkpointed = False  # recompute the unit's whole forward, gather included, in backward
        self.keeps_activations = False  # checkpoint_all_but_last: among the last checkpointed units
        self.fit_plan = None  # checkpoint_all_but_last="fit": the root's plan, while it measures
        self.inner_forward: Optional[Callable] = None  # another library's forward, adopted at wrap time
        self.device_mesh = None  # what the unit's `device_mesh` reports
        self.mp_policy = None  # FSDP2's MixedPrecisionPolicy (its output_dtype applies at the root)
        self.offload = None  # FSDP2's CPUOffloadPolicy at work (fsdp/offload.py's HostOffload)
        self.given_storage = False  # FSDP2: to_empty() gave the meta parameters storage
        self.loop_group = None  # scan_layers' stored stacks: layer 0's records, the loop's sizes
        self.region = None
        if group.comm.is_single_controller:
            self.region = ManualRegion(group.comm.placement, group.comm, options.is_batched_input)

    # -- properties --------------------------------------------------------
    @property
    def _reshards_after_forward(self) -> bool:
        # not while recomputing: the backward of the recomputation follows at once
        return (self.options.strategy not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
                and not (self.is_root and self.options.reshard.disable_reshard_on_root)
                and not is_recomputing() and self.options.reshard.reshard_after_forward)

    # -- unshard() / reshard() ---------------------------------------------
    def unshard(self) -> None:
        """Register every parameter of the unit whole until `reshard`: in its own dtype, or (FSDP2's unshard) in the
        compute dtype, as the forward would gather it."""
        if self.unsharded is not None:
            return
        full = self.group.full_params()
        mp = self.options.mixed_precision
        if self.unshard_feeds_forward and mp.enabled:
            full = [t.to(mp.compute_dtype) if t.is_floating_point() else t for t in full]
        for p, t in zip(self.group.params, full):
            p.register(t)
        self.unsharded = full

    def reshard(self, writeback: bool = False) -> None:
        """Back to the shards; with `writeback`, changes made to the full parameters are kept."""
        if self.unsharded is None:
            return
        for p, t in zip(self.group.params, self.unsharded):
            if writeback:
                p.load_full(t.detach(), self.group.comm)
            p.register(p.sharded)
        self.unsharded = None

    def forward(self, run: Callable, args: Tuple, kwargs: Dict, module: Optional[torch.nn.Module] = None) -> Any:
        if self.unsharded is not None and self.unshard_feeds_forward:
            # FSDP2: the forward's own gather (wired into autograd) replaces them; with or without autograd, since a
            # unit computing outside the engine would leave the units below it outside the single controller's region
            self.reshard()
        if self.unsharded is not None:
            if torch.is_grad_enabled() and any(p.requires_grad for p in self.group.params):
                raise RuntimeError("this unit is unsharded (unshard() or summon_full_params()): its gradients "
                                   "would not reach the shards. Call reshard(), or run under torch.no_grad()")
            return run(*args, **kwargs)  # the full parameters are registered: plain compute
        active = active_units()
        if self.is_root is None:
            self.is_root = not active
            self.group.ends_backward = self.is_root
        if self.is_root:
            self._check_runtime_unchanged()
            self._convert_foreign_checkpoints()
            if self.region is not None:  # the root of a single-controller model
                return self.region.run(self._module(), lambda a, k: self._forward(run, a, k, module), args, kwargs)
        return self._forward(run, args, kwargs, module)

    def _convert_foreign_checkpoints(self) -> None:
        if self._units is None:
            self._units = units(self._module())
        for unit in self._units:
            if "forward" in unit.__dict__:
                convert_checkpoint_after_wrapping(unit)
        convert_checkpoint_wrappers_around_units(self._module())
        checkpoint_all_but_last(self._module(), self._units, self.options.checkpoint_all_but_last,
                                self.group.comm.smallest)

    def _check_runtime_unchanged(self) -> None:
        comm = self.group.comm
        if comm.is_xla and not comm.is_single_controller:
            import torch_xla.runtime as xr

            if xr.is_spmd():
                raise RuntimeError(
                    f"{original_class(self._module()).__name__} was wrapped for one process per device, and "
                    "the SPMD runtime was turned on afterwards; call torch_xla.runtime.use_spmd() before "
                    "wrapping (and before creating any XLA tensor) to run the single-controller runtime")

    def _forward(self, run: Callable, args: Tuple, kwargs: Dict, module: Optional[torch.nn.Module] = None) -> Any:
        span = self._span
        if span is not None and not is_recomputing() and id(module) in span.waiting:
            return self._continue_span(run, args, kwargs, module)
        if span is not None:  # a module of the unit ran twice: the next pass of the unit
            self._close_span()
        active = active_units()
        if self.is_root:
            self._recording = [self]
        elif active and active[0]._recording is not None:
            active[0]._recording.append(self)
        if self.options.mixed_precision.enabled:  # [Note: every unit casts its own inputs]
            args, kwargs = cast_inputs(self.options.mixed_precision, args, kwargs)
        barrier_with = self._forward_barrier_tensors(args, kwargs)
        self.training_state = TrainingState.FORWARD
        # a gather started early (plain tensors) is wired into autograd here, so whoever started
        # it (a unit under no_grad, e.g. inside its checkpoint) cannot decide whether grads flow
        full, self._prefetched = self._prefetched, None
        if full is None and is_recomputing() and self._full_for_backward is not None:
            # a checkpointed unit re-running its forward in backward: the re-gather the
            # previous unit's backward started for it (BACKWARD_PRE/POST) is this forward's gather
            full, self._full_for_backward = self._full_for_backward, None
        targets = self.forward_prefetch_targets
        nxt = self._next_to_prefetch() if targets is None else None
        if full is None and nxt is not None and self.group.gathers_with(nxt.group):
            # [Note: the first gather of a step] this unit's gather and the one it prefetches
            # would both wait for the same input: one collective serves both
            full, nxt._prefetched = gather_together(self.group, nxt.group, barrier_with)
        full = self.group.gather_for_forward(barrier_with, gathered=full)
        if nxt is not None and nxt._prefetched is None:
            nxt._prefetched = nxt.group.gather(barrier_with)
        for target in (targets or []) if not is_recomputing() else []:
            if target._prefetched is None and target.unsharded is None and target._span is None:
                target._prefetched = target.group.gather(barrier_with)
        reshard = self._reshards_after_forward and torch.is_grad_enabled()
        for p, t in zip(self.group.params, full):
            p.register(t)
        if reshard:
            registry().update((id(t), (self, i, t)) for i, t in enumerate(full))
        if len(self.modules) > 1 and not is_recomputing():  # [Note: a unit of several modules]
            self._span = _Span(full, reshard, torch.is_grad_enabled(), {id(r()) for r in self.modules} - {id(module)})
        try:
            out = self._compute(run, args, kwargs, reshard)
        finally:
            if self._span is None:
                self._register_shards(full)
        if self._span is None:
            self._after_forward(full, reshard, torch.is_grad_enabled())
        if torch.is_grad_enabled():
            self._register_pre_backward(out)
        if self.is_root:
            self.group.hold_step_loss(out)  # [Note: the loss before the backward's reductions]
            for state in [state_of(m) for m in self._units or []]:
                if state._span is not None:  # a module of that unit did not run this pass
                    state._close_span()
            self._learn_order()
        return out

    def _compute(self, run: Callable, args: Tuple, kwargs: Dict, reshard: bool) -> Any:
        """The module's own forward, this unit active; with `reshard`, saved full parameters become tokens."""
        active = active_units()
        self.training_state = TrainingState.FORWARD
        active.append(self)
        try:
            with (torch.autograd.graph.saved_tensors_hooks(*make_hooks(
                    torch._C._autograd._top_saved_tensors_default_hooks(False))) if reshard else contextlib.nullcontext()):
                return run(*args, **kwargs)
        finally:
            active.pop()
            self.training_state = TrainingState.IDLE

    def _register_shards(self, full: List[torch.Tensor]) -> None:
        for p in self.group.params:
            p.register(p.sharded)
        reg = registry()
        for t in full:
            reg.pop(id(t), None)

    def _after_forward(self, full: List[torch.Tensor], reshard: bool, grad: bool) -> None:
        if reshard:
            self._release(full)
        else:
            self._full_for_backward = full if grad else None

    # -- a unit of several modules (fully_shard([a, b])) -------------------------
    def _continue_span(self, run: Callable, args: Tuple, kwargs: Dict, module) -> Any:
        """A later module of the unit in the same pass: the first module's gather serves it."""
        span = self._span
        span.waiting.discard(id(module))
        if self.options.mixed_precision.enabled:
            args, kwargs = cast_inputs(self.options.mixed_precision, args, kwargs)
        out = self._compute(run, args, kwargs, span.reshard)
        if not span.waiting:
            self._close_span()
        if torch.is_grad_enabled():
            self._register_pre_backward(out)
        return out

    def _close_span(self) -> None:
        span, self._span = self._span, None
        self._register_shards(span.full)
        self._after_forward(span.full, span.reshard, span.grad)

    # -- prefetch -------------------------------------------------------------
    def _next_to_prefetch(self) -> Optional["FSDPState"]:
        """The unit whose gather this unit starts, tied to its own input, so that it runs while this unit computes; None
        when prefetch is off or there is nothing to start."""
        nxt = self.next_forward
        if (nxt is None or not self.options.prefetch.forward or is_recomputing()
                or nxt._prefetched is not None or nxt.unsharded is not None or nxt._span is not None):
            return None
        return nxt

    def _learn_order(self) -> None:
        """After the root's forward: the order its units ran in is next step's prefetch order."""
        order, self._recording = self._recording or [self], None
        states = [state_of(m) for m in self._units] if self._units is not None else order
        for state in states:
            # every unit, not only those that ran: a gather started for one that did not run this
            # time (the order changed) would hold old values by the time it runs
            state._prefetched = None
            state.next_forward = state.next_backward = None
        for before, after in zip(order, order[1:]):
            before.next_forward = after
            after.next_backward = before
        if len(order) > 1:  # backward starts at the root's outputs, then the last unit to run forward
            order[0].next_backward = order[-1]

    def _forward_barrier_tensors(self, args, kwargs) -> Tuple[torch.Tensor, ...]:
        """An input activation to tie the forward gather to, so XLA cannot hoist it earlier."""
        if not (self.group.comm.is_xla and self.options.collectives.optimization_barrier_in_forward):
            return ()
        leaves, _ = tree_flatten((args, kwargs))
        x = next((x for x in leaves if isinstance(x, torch.Tensor) and x.device == self.group.comm.device), None)
        return () if x is None else (x.detach(),)

    def _release(self, full: List[torch.Tensor]) -> None:
        if not self.group.comm.is_xla:
            for t in full:
                if t.device.type == "cpu":
                    t.untyped_storage().resize_(0)

    # -- backward ----------------------------------------------------------
    def _register_pre_backward(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor):
        if self.is_root and self.training_state != TrainingState.PRE_BACKWARD:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        self.training_state = TrainingState.PRE_BACKWARD
        in_backward = self.options.collectives.optimization_barrier_in_backward and self.group.comm.is_xla
        barrier = (grad.detach(),) if in_backward else ()
        if self._full_for_backward is None and self._reshards_after_forward:
            self._full_for_backward = self.group.gather(barrier)
        if self.options.prefetch.backward == "BACKWARD_PRE":
            self._prefetch_next_backward(barrier)
        return grad

    def _prefetch_next_backward(self, barrier) -> None:
        """Gather the unit whose backward comes next (or the units named by `backward_prefetch_targets`), tied to
        `barrier`: it runs during this unit's backward."""
        targets = self.backward_prefetch_targets
        for nxt in targets if targets is not None else [self.next_backward]:
            if nxt is not None and nxt._full_for_backward is None and nxt._reshards_after_forward \
                    and nxt.unsharded is None:
                nxt._full_for_backward = nxt.group.gather(barrier)

    def full_params_for_backward(self) -> List[torch.Tensor]:
        if self._full_for_backward is None:  # an output escaped the pre-backward hook
            self._full_for_backward = self.group.gather()
        return self._full_for_backward

    def _after_grads_reduced(self, reduced: List[Optional[torch.Tensor]]) -> None:
        self._full_for_backward = None
        if self.options.prefetch.backward == "BACKWARD_POST" and self.training_state == TrainingState.PRE_BACKWARD:
            done = [g.detach() for g in reduced if g is not None][:1]
            self._prefetch_next_backward(done if self.group.comm.is_xla else ())

    def _finalize_backward(self) -> None:
        module = self._module()
        if module is None:
            return
        for state in (state_of(m) for m in units(module)):
            state.training_state = TrainingState.IDLE
            state._full_for_backward = None
        if self.options.sync_on_finalization:
            self.group.comm.sync([p.grad for p in module.parameters() if p.grad is not None])
