"""What a module computes with: a gathered, compute-dtype view of its sharded parameters (the SPMD engine's unshard,
written as a sharding).

[Note: gathering parameters by annotation]
Sharding a weight on dim 0 and the activations on the batch does not make GSPMD do FSDP: for `x @ W` with W split on its
contracting dim the partitioner may instead move `x` to a contracting-dim split (all-to-all) and all-reduce partial
sums, i.e. tensor parallelism with activation traffic. So, with `gather_params=True`, for the length of each module's
own forward, every parameter is swapped for a view annotated as replicated (`ShardedView`): the forward must all-gather
the weight, and the view's gradient is annotated with the Parameter's dim-0 sharding, so the backward reduce-scatters
it. That is FSDP exactly, and leaves activations batch-sharded end to end. It is off by default: with the batch
annotations (activations.py) GSPMD already gathers the blocks' weights and keeps their activations on the batch split,
and where it may choose (embedding lookup, LM head) it picks vocab-parallel forms that move activations instead of the
table; on the CPU benchmark both settings measure the same. Turn it on where weight traffic must stay independent of
batch and sequence length (large activations) or to get exactly FSDP's collectives.

[Note: casting sharded parameters]
With a compute dtype the view is `param.to(compute_dtype)` before the replicated annotation. The cast is differentiable,
so the gradient lands on the fp32 Parameter in fp32, and because the cast precedes the gather the partitioner gathers
the low-precision copy (half the bytes).

The swap writes `module._parameters[name]` directly, the same trick PyTorch FSDP2 uses, because `setattr` refuses a
non-Parameter. It is per module owning the tensor, not per unit, so a checkpointed unit recomputes (and re-gathers) the
same views in backward.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs
from torch.utils.hooks import RemovableHandle

from xla_fsdp.runtime.mesh import ShardedView, param_spec


class ComputeView:
    """Swaps a module's own parameters for their compute views during forward."""

    def __init__(self, module: nn.Module, dtype: Optional[torch.dtype], mesh: xs.Mesh, gather: bool):
        self.module = module
        self.dtype = dtype
        self.mesh = mesh
        self.gather = gather
        self.masters: Dict[str, nn.Parameter] = {}

    def enter(self) -> None:
        if self.masters:  # re-entered (e.g. recursion); views already in place
            return
        for name, param in list(self.module._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            view = param if self.dtype is None else param.to(self.dtype)
            if self.gather and view.dim() > 0:
                view = ShardedView.apply(view, self.mesh, (None,) * view.dim(), param_spec(view))
            self.masters[name] = param
            self.module._parameters[name] = view

    def exit(self) -> None:
        for name, param in self.masters.items():
            self.module._parameters[name] = param
        self.masters = {}


def owns_parameters(module: nn.Module) -> bool:
    """Whether `module` itself (not a child) registers a parameter."""
    return any(p is not None for p in module._parameters.values())


def cast_floating(tree, dtype: torch.dtype):
    """Casts every floating tensor in a (possibly nested) args structure."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, tuple):
        return tuple(cast_floating(t, dtype) for t in tree)
    if isinstance(tree, list):
        return [cast_floating(t, dtype) for t in tree]
    if isinstance(tree, dict):
        return {k: cast_floating(v, dtype) for k, v in tree.items()}
    return tree


def install_compute_views(root: nn.Module, dtype: Optional[torch.dtype], mesh: xs.Mesh,
                          gather: bool) -> Tuple[List[RemovableHandle], Dict[nn.Module, ComputeView]]:
    """Installs views on every module under `root` owning parameters; with a compute dtype, also casts root's floating
    inputs. Returns the hook handles and the per-module views (the checkpoint wrapper re-enters a unit's own view during
    recompute, which runs outside hooks)."""
    handles: List[RemovableHandle] = []
    views: Dict[nn.Module, ComputeView] = {}
    if dtype is None and not gather:
        return handles, views  # the view would be the parameter itself
    for module in root.modules():
        if not owns_parameters(module):
            continue
        view = ComputeView(module, dtype, mesh, gather)
        views[module] = view
        handles.append(module.register_forward_pre_hook(lambda m, args, v=view: v.enter()))
        # always_call: a forward that raises must still put the masters back.
        handles.append(module.register_forward_hook(lambda m, args, out, v=view: v.exit(), always_call=True))

    if dtype is not None:

        def cast_inputs(module: nn.Module, args: Tuple, kwargs: Dict):
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)

        handles.append(root.register_forward_pre_hook(cast_inputs, with_kwargs=True, prepend=True))
    return handles, views
