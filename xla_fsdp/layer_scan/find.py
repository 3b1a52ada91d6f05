"""Which ModuleLists scan_layers can run as one loop (identical wrapped units), and the template of layer 0 the loop
body runs ([Note: scanning the layers of a ModuleList] in scanned_list.py)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn


def check_identical(layers: Sequence[nn.Module], where: str) -> None:
    """Raises ValueError unless the layers have one class and the same parameter and buffer names, shapes and dtypes."""
    first = layers[0]
    kinds = {type(layer).__name__ for layer in layers}
    if len(kinds) > 1:
        raise ValueError(f"scan_layers: {where} holds layers of different classes ({', '.join(sorted(kinds))}); a "
                         "scanned loop runs one layer's program for every layer. Turn scan_layers off for this model.")

    def signature(layer: nn.Module) -> Dict[str, Tuple]:
        return {name: (tuple(t.shape), t.dtype, isinstance(t, nn.Parameter))
                for name, t in list(layer.named_parameters()) + list(layer.named_buffers())}

    reference = signature(first)
    for index, layer in enumerate(layers[1:], start=1):
        mine = signature(layer)
        if mine == reference:
            continue
        names = sorted(set(mine) ^ set(reference))
        if names:
            raise ValueError(f"scan_layers: layer {index} of {where} differs from layer 0 in its "
                             f"tensors {names[:4]}; every scanned layer must have the same "
                             "parameters and buffers. Turn scan_layers off for this model.")
        name = next(n for n in reference if reference[n] != mine[n])
        raise ValueError(f"scan_layers: layer {index} of {where} has {name} of shape/dtype "
                         f"{mine[name][:2]} where layer 0 has {reference[name][:2]}; every "
                         "scanned layer must be identical. Turn scan_layers off for this model.")
    if any(layer.__dict__.get("forward") is not None for layer in layers):
        raise ValueError(f"scan_layers: a layer of {where} has its own instance `forward`; "
                         "the loop runs the class's forward for every layer.")


def _hook_keys(layers: Sequence[nn.Module]) -> Dict[int, Tuple[frozenset, ...]]:
    return {id(m): (frozenset(m._forward_pre_hooks), frozenset(m._forward_hooks), frozenset(m._backward_hooks))
            for layer in layers for m in layer.modules()}


def _template(layer: nn.Module) -> nn.Module:
    """A copy of `layer` whose tensors are meta (functional_call supplies them) and whose modules carry no hooks (the
    engine's hooks act on the real modules; inside the loop body the partitioner places the tensors). A layer
    checkpointed by transformers (`gradient_checkpointing_enable()`) is not checkpointed again inside the traced body:
    the loop recomputes it (`hf_checkpointed`)."""
    memo: Dict[int, Any] = {}
    for tensor in list(layer.parameters()) + list(layer.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    template = copy.deepcopy(layer, memo)
    from xla_fsdp.activation_checkpoint import strip_checkpoint

    strip_checkpoint(template)  # checkpoint_module(layer): the loop recomputes instead
    for module in template.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
                      module._backward_pre_hooks):
            hooks.clear()
        if getattr(module, "gradient_checkpointing", False) is True:
            module.gradient_checkpointing = False
    return template


def hf_checkpointed(layer: nn.Module) -> bool:
    """Whether the layer is checkpointed by transformers (GradientCheckpointingLayer)
    or by `xla_fsdp.checkpoint_module` (run_clm's --gradient_checkpointing)."""
    from xla_fsdp.activation_checkpoint import _CheckpointMixin

    return isinstance(layer, _CheckpointMixin) or any(getattr(m, "gradient_checkpointing", False) is True
                                                      for m in layer.modules())


Found = List[Tuple[nn.Module, str, List[nn.Module], str]]


def find_layer_lists(root: nn.Module, units: Sequence[nn.Module],
                     check: Optional[Callable[[nn.Module, List[nn.Module], str], None]] = None) -> Found:
    """Every ModuleList of `root` whose children are all (non-root) units, as (owner, attribute, layers, dotted name),
    checked to be identical. Raises ValueError when there is none (the wrap policy must make the repeated layer a unit)
    or when the layers are not identical."""
    unit_ids = {id(u) for u in units[:-1]}
    found: Found = []
    for owner_name, owner in list(root.named_modules()):
        for name, child in list(owner.named_children()):
            if type(child) is not nn.ModuleList or len(child) < 2:
                continue
            layers = list(child)
            if not all(id(layer) in unit_ids for layer in layers):
                continue
            where = f"{owner_name}.{name}" if owner_name else name
            check_identical(layers, where)
            if check is not None:  # the engine's own conditions (the SPMD engine's stored stacks)
                check(root, layers, where)
            found.append((owner, name, layers, where))
    if not found:
        raise ValueError("scan_layers found no nn.ModuleList whose layers are all wrapped units; make the repeated "
                         "layer class a unit (fsdp config fsdp_transformer_layer_cls_to_wrap, or an auto_wrap_policy "
                         "that wraps it) and keep the layers in an nn.ModuleList.")
    return found
