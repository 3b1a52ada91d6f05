"""`shard_output`: what torch_xla's FSDPv2 calls on each wrapped module's output.

torch_xla's wrapper runs `shard_output(output, mesh)` after the module's forward, for the root and for every
auto-wrapped unit, and ignores what it returns (it annotates in place). Its default marks the output, or the first
element of a tuple output, as split on dim 0 over the batch axes, and refuses any other output. Both only annotate:
values never change. The GSPMD engine has already annotated the same tensors along the batch when the hook runs, so with
the default the annotation is the same one; a user's `shard_output` (Hugging Face's marks `output.logits`) overrides it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..class_swap import original_class

ShardOutput = Callable[[Any, Any], Any]


def output_spec(tensor: torch.Tensor, batch_axes: Sequence[str]) -> tuple:
    """torch_xla's default spec: dim 0 over the batch axes (`(extra_data_axis, "fsdp")` or `"fsdp"`), the rest
    replicated; a 0-dim tensor replicated."""
    if tensor.dim() == 0:
        return ()
    first = batch_axes[0] if len(batch_axes) == 1 else tuple(batch_axes)
    return (first,) + (None,) * (tensor.dim() - 1)


def default_shard_output(output: Any, mesh, batch_axes: Sequence[str], owner: str) -> None:
    """torch_xla's default `shard_output`, with `owner` (the unit's class) named in its error."""
    import torch_xla.distributed.spmd as xs

    tensor: Optional[torch.Tensor] = None
    if isinstance(output, torch.Tensor):
        tensor = output
    elif isinstance(output, tuple):
        tensor = output[0] if output and isinstance(output[0], torch.Tensor) else None
        warnings.warn("The output is a tuple, but only the first element is sharded. If this is not intended, "
                      "please provide your own shard_output callable.")
    if tensor is None:
        raise RuntimeError(
            f"{owner} returned {type(output).__name__}; SpmdFullyShardedDataParallel's default shard_output takes "
            "a tensor or a tuple whose first element is a tensor (as torch_xla's does). Pass "
            "shard_output=fn(output, mesh) that marks the batch-split tensor, e.g. "
            "xs.mark_sharding(output.logits, mesh, ('fsdp', None, None))")
    xs.mark_sharding(tensor, mesh, output_spec(tensor, batch_axes))


def install(unit: nn.Module, shard_output: Optional[ShardOutput], mesh, batch_axes: Sequence[str]) -> None:
    """Run `shard_output` (torch_xla's default when None) on `unit`'s output after each forward, after the engine's own
    output annotation (a hook registered later runs later)."""
    owner = original_class(unit).__name__

    def hook(module: nn.Module, args, output):
        if shard_output is None:
            default_shard_output(output, mesh, batch_axes, owner)
        else:
            shard_output(output, mesh)
        # None: the output passes on unchanged (torch_xla ignores what shard_output returns)

    unit.register_forward_hook(hook)
