"""The SPMD engine's loop for scanned layers (`scan_layers`, engine="spmd").

The layers' ModuleList becomes a `ScannedLayers` (layer_scan/scanned_list.py, [Note: scanning the layers of a
ModuleList]); its first call runs this engine's loop: torch_xla's `scan` over their stacked parameters, traced once with
AOTAutograd. What stays per layer under FSDP: each layer's parameters are stacked on a new dim (stored stacked, or
stacked every step with "per_step"), the loop body slices one layer's shards, and the partitioner gathers them inside
the body and reduce-scatters their gradients there, so a chip holds one layer's full parameters at a time.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs

from xla_fsdp.layer_scan.find import Found, _template, hf_checkpointed
from xla_fsdp.layer_scan.scanned_list import ScannedLayers, ScanRun, no_cache_by_default
from xla_fsdp.layer_scan.scanned_list import ScanSettings as _Shared
from xla_fsdp.layer_scan.stored_stacks import SUFFIX
from xla_fsdp.layer_scan.gspmd.stacked import stacked_view, store_stacked
from xla_fsdp.memory.remat_policy import FULL, RematPolicy, note_applied, saved_modules


class ScanSettings(_Shared):
    """What every scanned ModuleList of one model shares on the SPMD engine."""

    def __init__(self, mesh: xs.Mesh, compute_dtype: Optional[torch.dtype],
                 annotate: Callable[[torch.Tensor], torch.Tensor], recompute: bool, stored: bool = True,
                 batch_entry: Optional[Callable[[torch.Tensor], Any]] = None, policy: Optional[RematPolicy] = None):
        super().__init__(gspmd_loop, compute_dtype, stacked_view)
        self.mesh = mesh
        self.batch_entry = batch_entry  # the mesh axes of a batch tensor's dim 0, else None
        self.annotate = annotate
        self.recompute = recompute
        self.stored = stored  # parameters stored stacked ([Note: parameters stored stacked])
        self.policy = policy  # what a recomputed layer saves ([Note: recomputation policies]); None: "full"


def gspmd_loop(run: ScanRun, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    """The layers of `run` as torch_xla's `scan` (the first layer's call)."""
    from torch_xla.experimental.scan import scan
    from torch.utils._pytree import tree_unflatten
    from functorch.compile import default_partition

    from xla_fsdp.layer_scan.gspmd.scan_glue import policy_partition, use_shard_like
    from xla_fsdp.memory.saved_outputs import marking, tag_op
    from xla_fsdp.layer_scan.keyed_random import KeyedRandom, layer_keys

    use_shard_like()
    settings = run.owner._scan_settings
    others, tree = run.other_arguments(args, kwargs)
    template = run.owner.template()
    names = [n for n, _ in template.named_parameters()]
    buffer_names = [n for n, _ in run.layers[0].named_buffers()]
    stacked: Dict[str, torch.Tensor] = {}
    stored = run.owner.stored()
    for name in names:  # [Note: parameters stored stacked]
        stack = stored[name] if stored else torch.stack([layer.get_parameter(name) for layer in run.layers])
        if settings.compute_dtype is not None and stack.is_floating_point():
            stack = stack.to(settings.compute_dtype)  # [Note: casting sharded parameters]
        if stack.dim() > 1:
            spec = (None, "fsdp") + (None,) * (stack.dim() - 2)
            xs.mark_sharding(stack, settings.mesh, spec)
        stacked[name] = stack
    for name in buffer_names:
        stacked[name] = torch.stack([layer.get_buffer(name) for layer in run.layers])
    # The other arguments' tensors (mask, positions, rotary tables) enter the loop as per-trip inputs, the same for
    # every trip: AOTAutograd traces the layer with fake tensors and refuses real ones captured from outside.
    layers = len(run.layers)
    where = [i for i, t in enumerate(others) if isinstance(t, torch.Tensor)]
    repeated = [others[i].unsqueeze(0).expand(layers, *others[i].shape) for i in where]
    shape_out: List[Any] = []

    # one key per layer and sequence for the dropout masks ([Note: dropout under scan])
    keys = layer_keys(layers, args[0])
    entry = settings.batch_entry(args[0]) if settings.batch_entry is not None else None
    if entry is not None:
        xs.mark_sharding(keys, settings.mesh, (None, entry))

    recompute = settings.recompute or (run.owner.training and hf_checkpointed(run.layers[0]))
    policy = (settings.policy or FULL) if recompute else None
    marked = saved_modules(template, policy, run.owner._scan_where) if policy is not None else []
    offload = policy is not None and policy.offload
    if policy is not None:
        note_applied(run.layers, policy, "scanned")

    def one_layer(hidden: torch.Tensor, x):
        tensors, extra, key = x
        if offload:  # [Note: host offload]: the layer's input is saved as its mark
            hidden = tag_op()(hidden, "input")
        leaves = list(others)
        for i, t in zip(where, extra):
            leaves[i] = t
        rest, named = tree_unflatten(leaves, tree)
        with KeyedRandom(key, run.owner._scan_where), marking(marked):
            out = torch.func.functional_call(template, tensors, (hidden,) + tuple(rest), named, strict=True)
        if not shape_out:
            shape_out.append(out)
        return run._hidden(out), None

    hidden = settings.annotate(args[0])
    if policy is None or policy.keeps_all:  # no checkpointing, or "none": the layer keeps everything
        partition = default_partition
    else:
        partition = functools.partial(policy_partition, marks=bool(marked or offload), offload=offload)
    final, _ = scan(one_layer, hidden, (stacked, repeated, keys), partition_fn=partition)
    return run.shaped(settings.annotate(final), shape_out[0])


def install_scans(root: nn.Module, found: Found, settings: ScanSettings) -> None:
    """Swaps each found ModuleList for a ScannedLayers (after the engine's own hooks are in place: those are the ones a
    scanned layer may carry); no KV cache by default (`no_cache_by_default`)."""
    for owner, name, layers, where in found:
        scanned = ScannedLayers(layers, settings, where)
        scanned.template()  # from a layer that still holds its parameters
        setattr(owner, name, scanned)
        if settings.stored:
            store_stacked(owner, name, layers, _template(layers[0]), settings.mesh)
            scanned._scan_store.append(getattr(owner, name + SUFFIX))
    no_cache_by_default(root)
