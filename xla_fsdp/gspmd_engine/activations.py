"""Activation shardings and activation checkpointing for SPMD units.

[Note: why annotate activations]
With only the parameters annotated, GSPMD propagates the dim-0 parameter sharding into the activations (e.g. a
row-sharded embedding makes the hidden states look sharded on a feature dim) and later has to undo it with a full
rematerialization ("Involuntary full rematerialization" in the XLA log). Pinning every unit's inputs and outputs, and
their gradients, to a batch-dim sharding leaves the partitioner one consistent choice: gather the parameter, keep the
batch split. Annotations never change values, only layouts.

Unit boundaries alone are not enough inside a unit. The weight gradient of `x @ W` with W sharded on dim 0 is local if
`x` is split on its feature dim, so propagating backwards from the gradient's sharding GSPMD moved GPT-2's attention
output (an unannotated chain of reshapes and transposes) to a feature split: 4 all-to-alls and an activation-sized
all-reduce per block. So the inputs of every module that owns parameters are pinned to the batch split too (the matmul's
input is then fixed and the weight is gathered).

Only tensors whose dim 0 equals the batch size seen at the root are annotated; anything else (masks broadcast over the
batch, position tables) is left to propagation.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs

from xla_fsdp.activation_checkpoint import checkpointed_call
from xla_fsdp.memory.remat_policy import set_policy
from xla_fsdp.runtime.mesh import ShardedView, batch_spec, data_degree
from xla_fsdp.gspmd_engine.params import ComputeView
from xla_fsdp.gspmd_engine.units import is_sharded


class BatchSharding:
    """Annotates batch-dim activations; learns the batch size at the root.
    The batch is split over `axes` (default every mesh axis)."""

    def __init__(self, mesh: xs.Mesh, axes: Optional[Sequence[str]] = None):
        self.mesh = mesh
        self.axes = None if axes is None else tuple(axes)
        self.batch_size: Optional[int] = None
        self._warned = False

    def spec(self, tensor: torch.Tensor):
        return batch_spec(tensor, self.mesh, self.axes)

    def batch_entry(self, tensor: torch.Tensor):
        """The mesh axes `tensor`'s dim 0 is split over when it is a batch, else None."""
        return self.spec(tensor)[0] if self._applies(tensor) else None

    def _applies(self, tensor: Any) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and self.batch_size is not None
                and tensor.shape[0] == self.batch_size)

    def root_inputs(self, module: nn.Module, args: Tuple, kwargs: Dict) -> None:
        """Forward pre-hook of the root: shards batch inputs in place."""
        first = next((t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0),
                     None)
        self.batch_size = None if first is None else int(first.shape[0])
        shards = data_degree(self.mesh, self.axes)
        if self.batch_size is not None and self.batch_size % shards != 0:
            if not self._warned:
                warnings.warn(f"batch size {self.batch_size} is not divisible by the {shards} shards of the batch "
                              "(devices of its mesh axes); activations are left unannotated and the partitioner may "
                              "replicate them. Use a global batch that is a multiple of the device count.")
                self._warned = True
            self.batch_size = None
            return
        for tensor in list(args) + list(kwargs.values()):
            # In place: the inputs are usually device data, and sharding the data itself means each device only
            # receives its slice.
            if self._applies(tensor) and not is_sharded(tensor):
                xs.mark_sharding(tensor, self.mesh, self.spec(tensor))

    def annotate(self, tree: Any) -> Any:
        """Batch-shards tensors in `tree` and, through autograd, their grads."""
        if self._applies(tree):
            spec = self.spec(tree)
            return ShardedView.apply(tree, self.mesh, spec, spec)
        if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
            return tuple(self.annotate(t) for t in tree)
        if isinstance(tree, list):
            return [self.annotate(t) for t in tree]
        if isinstance(tree, dict):
            # Model outputs (dict subclasses) cannot always be rebuilt; annotate their tensors in place (forward only).
            for value in tree.values():
                if self._applies(value):
                    xs.mark_sharding(value, self.mesh, self.spec(value))
        return tree

    def unit_inputs(self, module: nn.Module, args: Tuple, kwargs: Dict):
        return self.annotate(args), self.annotate(kwargs)

    def unit_output(self, module: nn.Module, args: Tuple, output: Any) -> Any:
        return self.annotate(output)


class CheckpointedForward:
    """A unit's forward run under xla_fsdp's activation checkpoint, the collectives engine's
    (xla_fsdp/activation_checkpoint.py), recomputation behind an optimization barrier included ([Note: recompute
    barrier]). Not torch_xla's checkpoint, which gave a unit fed only data (the first layer) no parameter gradients
    ([Note: parameters as checkpoint inputs]) and updated BatchNorm statistics a second time in the recomputation
    ([Note: what a recomputation sees])."""

    def __init__(self, unit: nn.Module, inner: Callable[..., Any], own_view: Optional[ComputeView]):
        self.unit = unit
        self.inner = inner
        self.own_view = own_view

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            # The unit's own parameter views are set by hooks around __call__, which the recompute does not go through.
            if self.own_view is not None:
                self.own_view.enter()
            try:
                return self.inner(*a, **k)
            finally:
                if self.own_view is not None:
                    self.own_view.exit()

        # Off autograd it runs plainly; KV caches are dropped (`without_kv_cache`).
        return checkpointed_call(run, args, kwargs, self.unit)


def checkpoint_unit(unit: nn.Module, own_view: Optional[ComputeView], remat_policy=None) -> None:
    """Replaces `unit.forward` (instance attribute) by a checkpointed one that saves what `remat_policy`
    says ([Note: recomputation policies]; None: the unit's own, default "full")."""
    set_policy(unit, remat_policy)
    if isinstance(unit.__dict__.get("forward"), CheckpointedForward):
        return
    unit.forward = CheckpointedForward(unit, unit.forward, own_view)
