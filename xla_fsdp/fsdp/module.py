"""`FSDPModule`: the class `fully_shard` mixes into a module, with FSDP2's methods.

A methods-only front door over the unit's engine state ([Note: one engine state per unit]), as PyTorch's `FSDPModule` is
over its `FSDPState`: the collective engine on the single controller does the work (gathers just in time, prefetch,
reduce-scatter, state dicts in the unwrapped shapes); `UnitMethods` gives it the forward and the methods both front
doors share (`unshard`, `reshard`, `set_requires_gradient_sync`, `device_mesh`). What FSDP2 adds lives here: meta
modules kept on the meta device until `to_empty()`, FSDP2's names for prefetch and gradient reduction, the root's output
dtype, CPU offload and the step cut. It is not an `XlaFullyShardedDataParallel`: torch_xla's methods (`no_sync`,
`summon_full_params`, `get_shard_metadata`, `.module`) are not FSDP2's."""
from __future__ import annotations

import dataclasses
from typing import List

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .. import abstract
from ..api import UnitMethods, UnshardHandle
from ..collective_engine.saved_params import active_units
from ..unit_state import state_of, units
from ..collective_engine.sharded_param import ShardedParameter

__all__ = ["FSDPModule", "UnshardHandle"]


class FSDPModule(UnitMethods):
    """A module sharded by `xla_fsdp.fsdp.fully_shard` (PyTorch FSDP2's `FSDPModule`)."""

    # -- forward -----------------------------------------------------------
    def forward(self, *args, **kwargs):
        state = state_of(self)
        outermost = not active_units()
        if outermost:
            from . import step_cut

            step_cut.settle()  # [Note: the step cut]
        offload = state.offload if outermost else None
        if offload is not None and not _meta_params(self):
            offload.to_device(self)
        meta = _meta_params(self)
        if meta:
            raise RuntimeError(
                f"{type(self).__name__}'s parameters are on the meta device ({', '.join(meta[:3])}): after "
                "fully_shard, call model.to_empty(device=torch_xla.device()) and initialize them "
                "(model.reset_parameters(), or load a state dict) before the forward")
        out = super().forward(*args, **kwargs)
        if offload is not None:
            offload.after_forward(self, out)
        dtype = state.mp_policy.output_dtype
        if outermost and dtype is not None:
            out = tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, out)
        return out

    # -- storage -----------------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True):
        """FSDP2's meta-device flow: give every sharded parameter (of this unit and the units in it) uninitialized
        storage on the chips, each chip its own rows only (host memory under CPUOffloadPolicy), and every other tensor
        storage on `device`, as nn.Module.to_empty does. Then initialize, e.g. `model.reset_parameters()`."""
        from ..collective_engine import model_state, optimizer_state

        for unit in _units(self, recurse):
            state = state_of(unit)
            group = state.group
            fresh = [rec for rec in group.params if rec.sharded.is_meta]
            offload = state.offload is not None
            for rec in fresh:
                if offload:  # [Note: CPU offload on the single controller]: host storage
                    where = "meta" if abstract.active() else "cpu"  # traced for the check: no host memory
                    rec.sharded = rec.param_cls(torch.empty((rec.padded_rows, *rec.row_shape), dtype=rec.orig_dtype,
                                                            device=where), requires_grad=rec.requires_grad)
                    rec.register(rec.sharded)
                else:
                    rec.materialize_on(group.comm)
                rec.sharded.bind(rec, state.device_mesh)
            padded = [r for r in fresh if model_state.is_padded(r)]
            if padded and group.comm.is_single_controller:
                optimizer_state.register_padded(padded, group.comm)
        for unit in _units(self, recurse):
            state_of(unit).given_storage = True
        device = torch.device(device)
        return nn.Module._apply(self, lambda t: t if isinstance(t, ShardedParameter)
                                else torch.empty_like(t, device=device), recurse)

    # -- schedule ----------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether units free their gathered parameters after forward and gather again in backward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}")
        for unit in _units(self, recurse):
            state = state_of(unit)
            reshard = dataclasses.replace(state.options.reshard, reshard_after_forward=reshard_after_forward,
                                          disable_reshard_on_root=False)
            state.options = dataclasses.replace(state.options, reshard=reshard)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Accepted, no effect: the parameters gathered in backward are buffers of the step's XLA program and die with
        it; nothing stays gathered between steps to keep or free."""

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these units' gathers when this unit's forward starts (tied to its input), in place of the engine's
        default of the unit that ran next last step."""
        state_of(self).forward_prefetch_targets = [_unit_state(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these units' backward re-gathers when this unit's backward starts."""
        state_of(self).backward_prefetch_targets = [_unit_state(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted, no effect: every backward finishes its reduce-scatters inside the step's program; gradients held
        back by set_requires_gradient_sync(False) are folded into the next backward that syncs."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Accepted, no effect: under HSDP every backward that reduces also all-reduces over the replicate dim; skipping
        it for some micro-batches and doing it on the last gives the same gradients (the all-reduce is linear), so only
        the traffic differs."""

    def set_post_optim_event(self, event) -> None:
        """Accepted, no effect: XLA orders the next forward's gathers after the optimizer step by data dependencies;
        there are no streams to synchronize."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduced gradients are the sum over processes divided by `factor` (default: the number of processes, so that
        the gradient is that of the mean loss over every process's batch)."""
        if not factor or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive number, got {factor!r}")
        from .device_mesh import process_count

        for unit in units(self):
            state_of(unit).group.grad_factor = process_count() / float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def _refused(name: str, why: str):
        def method(self, *args, **kwargs):
            raise NotImplementedError(f"FSDPModule.{name} is not supported by xla_fsdp.fsdp: {why}")

        method.__name__ = name
        method.__doc__ = f"Refused: {why}"
        return method

    set_custom_all_gather = _refused("set_custom_all_gather", "the all-gather is an XLA collective chosen by "
                                     "the engine (all_gather_impl); there is no process-group call to replace")
    set_custom_reduce_scatter = _refused("set_custom_reduce_scatter", "the reduce-scatter is an XLA collective "
                                         "in the traced program; there is no process-group call to replace")
    set_all_reduce_hook = _refused("set_all_reduce_hook", "the HSDP all-reduce is an XLA collective in the traced "
                                   "program; there is no process-group call to hook")
    set_force_sum_reduction_for_comms = _refused(
        "set_force_sum_reduction_for_comms", "use set_gradient_divide_factor(1.0) for summed gradients")
    set_unshard_in_backward = _refused("set_unshard_in_backward", "every unit that resharded after forward "
                                       "gathers again in backward; use reshard_after_forward=False to skip it")
    set_allocate_memory_from_process_group_for_comm = _refused(
        "set_allocate_memory_from_process_group_for_comm", "XLA allocates collective buffers itself")
    del _refused

    # -- state dicts --------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, for values of any kind FSDP2 scripts produce (CPU tensors, XLA tensors, `distribute_tensor`
        results, parameters of another sharded model); the parameters stay sharded, and with `assign=True` the sharded
        parameters take the values ([Note: loading into sharded parameters])."""
        from ..collective_engine.model_state import load_into

        return load_into(self, state_dict, strict, assign)


def _units(module: nn.Module, recurse: bool) -> List[nn.Module]:
    return units(module) if recurse else [module]


def _meta_params(unit: nn.Module) -> List[str]:
    """The unit's parameters without storage (built on meta, not yet given any), by name. Under the check's trace an
    offloaded host parameter is a meta tensor by design."""
    state = state_of(unit)
    offloaded = state.offload is not None and abstract.active()
    return [rec.fqn for rec in state.group.params
            if rec.sharded.is_meta and not (offloaded and rec.sharded.device.type == "meta" and state.given_storage)]


def _unit_state(module, what: str):
    state = state_of(module)
    if not isinstance(module, FSDPModule) or state is None:
        raise ValueError(f"{what} expects modules that fully_shard was applied to; {type(module).__name__} is not one")
    return state
