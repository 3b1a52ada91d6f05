"""Scanned layers' parameters stored stacked: one tensor per parameter name.

[Note: parameters stored stacked]
Stacking the layers' parameters for every step (`torch.stack` of each layer's shard, the gradients sliced back) leaves
an O(depth) part in the step's program: one copy per layer and parameter, and the optimizer's update once per layer and
parameter, most of the program (measured: the scanned 2B GPT-2 on v4-8 held 1142 of its 1325 fusions outside the loops,
262 once stored; docs/scan.md). So `scan_layers` stores each parameter of a scanned list once: the model holds
`<list>_scan.<name in the layer>` (e.g. `transformer.h_scan.attn.c_attn.weight`), the layers hold none, and the
optimizer updates one tensor per name whatever the depth.

Layout: a layer's parameter of shape (d0, *rest) is stored as (d0, L, *rest), the layers on dim 1, so dim 0 is still the
parameter's own dim 0 and sharding it over "fsdp" gives every device 1/N of every layer's rows, as without scan (and the
checkpoints, which shard on dim 0, hold it like any parameter). The loop takes `movedim(1, 0)`, one transpose per name.
A 0-dim parameter is stored as (L,).

What does not change: `state_dict()` names each layer's slice as the unscanned model does, in the same order, and
`load_state_dict()` stacks those keys again (save_pretrained, Hugging Face's Trainer and a plain model read and write
either way; xla_fsdp.checkpoint stores the stacks under their own names, `runtime.stored_keys`). Element-wise optimizers
(SGD, Adam, AdamW, ...) update the stack exactly as each layer's, and clipping's global norm is the same sum.

What does: an optimizer with per-tensor statistics (Adafactor's factored moments and update clipping, LAMB's trust
ratio) would see one tensor for all layers. Hugging Face's Adafactor, the recipe's, is run per layer on each stack
instead ([Note: Adafactor on stored stacks] in layer_scan/stacked_adafactor.py); the others are refused at their first
step, naming `scan_layers="per_step"` (per-layer parameters stacked every step), which keeps their exact behaviour.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs

from xla_fsdp.layer_scan.stored_stacks import StackRecord, attach, check_store_name, locate
from xla_fsdp.runtime import stored_keys
from xla_fsdp.runtime.mesh import FSDP_AXIS


def stacked_view(stored: torch.Tensor) -> torch.Tensor:
    """The stored (d0, L, *rest) tensor as (L, d0, *rest), what the loop slices."""
    return stored.movedim(1, 0) if stored.dim() > 1 else stored


def store_stacked(owner: nn.Module, attr: str, layers: Sequence[nn.Module], container: nn.Module,
                  mesh: xs.Mesh) -> StackRecord:
    """Moves every parameter of `layers` into `container` (a copy of layer 0's structure, off the layers) as one stored
    stack, sharded on dim 0; registers it on `owner` right after the list, and the state-dict hooks that keep per-layer
    keys. The layers keep their buffers."""
    check_store_name(owner, attr)
    names = [n for n, _ in layers[0].named_parameters()]
    order = list(layers[0].state_dict(keep_vars=True).keys())
    for name in names:
        per_layer = [layer.get_parameter(name) for layer in layers]
        with torch.no_grad():
            stored = stored_keys.stack_layers([p.detach() for p in per_layer])
        if stored.dim() > 1:
            xs.mark_sharding(stored, mesh, (FSDP_AXIS,) + (None,) * (stored.dim() - 1))
        param = nn.Parameter(stored, requires_grad=per_layer[0].requires_grad)
        param._xla_fsdp_stacked = True
        module, local = locate(container, name)
        module._parameters[local] = param
        for layer in layers:
            del locate(layer, name)[0]._parameters[local]
    record = StackRecord(attr, len(layers), names, order)
    attach(owner, attr, container, record)
    return record
