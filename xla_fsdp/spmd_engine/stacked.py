"""Scanned layers' parameters stored stacked: one tensor per parameter name.

[Note: parameters stored stacked]
Stacking the layers' parameters for every step (`torch.stack` of each layer's
shard, the gradients sliced back) leaves an O(depth) part in the step's
program: one copy per layer and parameter, and the optimizer's update once
per layer and parameter. It was most of the program: the
2B GPT-2 on v4-8, scanned that way, held 1142 of its 1325 fusions outside the
loops, and its HLO passes took 10 s of a 122 s compile (the rest is code
generation); stored once, the program held 262 fusions and compiled in 93 s
(what remains scales with the shapes: docs/scan.md). So `scan_layers` stores
each parameter of a scanned list once: the model holds
`<list>_scan.<name in the layer>` (e.g. `transformer.h_scan.attn.c_attn.weight`),
the layers hold none, and the
optimizer updates one tensor per name whatever the depth.

Layout: a layer's parameter of shape (d0, *rest) is stored as (d0, L, *rest),
the layers on dim 1, so dim 0 is still the parameter's own dim 0 and sharding
it over "fsdp" gives every device 1/N of every layer's rows, as without scan
(and the checkpoints, which shard on dim 0, hold it like any parameter). The
loop takes `movedim(1, 0)`, one transpose per name. A 0-dim parameter is
stored as (L,).

What does not change:
- `state_dict()` names each layer's slice as the unscanned model does, in
  the same order, and `load_state_dict()` takes those keys and stacks them:
  save_pretrained, Hugging Face's Trainer and a plain model read and write
  either way. xla_fsdp.checkpoint stores the stacked tensors under their own
  names (`runtime.stored_keys`): it loads into a scanned model.
- Element-wise optimizers (SGD, Adam, AdamW, ...) update the stacked tensor
  exactly as they would update each layer's, and clipping's global norm is
  the same sum.

What does: an optimizer with per-tensor statistics (Adafactor's factored
moments and update clipping, LAMB's trust ratio) would see one tensor for
all layers. Those are refused at their first step, naming
`scan_layers="per_step"` (stack every step, per-layer parameters), which
keeps their exact per-layer behaviour.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs

from xla_fsdp.runtime import stored_keys
from xla_fsdp.runtime.mesh import FSDP_AXIS

SUFFIX = "_scan"


@dataclass
class StackRecord:
  """One scanned list's stored parameters, kept on the list's owner."""
  attr: str  # the ModuleList's attribute on the owner
  layers: int
  names: List[str]  # the parameters' names inside a layer
  order: List[str]  # a layer's own state-dict keys (parameters and buffers), in order

  @property
  def store(self) -> str:
    return self.attr + SUFFIX


def check_stackable(root: nn.Module, layers: Sequence[nn.Module], where: str) -> None:
  """Raises ValueError when the layers' parameters cannot be stored as one stack:
  shared between layers or with the rest of the model, or trainable in some layers only."""
  inside = {}
  for index, layer in enumerate(layers):
    for name, p in layer.named_parameters(remove_duplicate=False):
      if id(p) in inside:
        raise ValueError(
            f"scan_layers: {where}.{index}.{name} is the same tensor as {inside[id(p)]}; shared "
            "weights cannot be stored stacked. Use scan_layers=\"per_step\" (stacks every step).")
      inside[id(p)] = f"{where}.{index}.{name}"
  owned = {id(p) for layer in layers for p in layer.parameters()}
  for name, p in root.named_parameters(remove_duplicate=False):
    if id(p) in owned and not any(name.startswith(f"{where}.{i}.") for i in range(len(layers))):
      raise ValueError(
          f"scan_layers: {name} is also a parameter of {where}; weights tied to a layer "
          "cannot be stored stacked. Use scan_layers=\"per_step\" (stacks every step).")
  first = dict(layers[0].named_parameters())
  for index, layer in enumerate(layers[1:], start=1):
    for name, p in layer.named_parameters():
      if p.requires_grad != first[name].requires_grad:
        raise ValueError(
            f"scan_layers: {where}.{index}.{name} has requires_grad={p.requires_grad} where layer 0 "
            f"has {first[name].requires_grad}; a stored stack is trained whole. Freeze or train the "
            "same parameters in every layer, or use scan_layers=\"per_step\".")


def stacked_view(stored: torch.Tensor) -> torch.Tensor:
  """The stored (d0, L, *rest) tensor as (L, d0, *rest), what the loop slices."""
  return stored.movedim(1, 0) if stored.dim() > 1 else stored


def _locate(root: nn.Module, dotted: str):
  owner_name, _, local = dotted.rpartition(".")
  return (root.get_submodule(owner_name) if owner_name else root), local


def store_stacked(owner: nn.Module, attr: str, layers: Sequence[nn.Module], container: nn.Module,
                  mesh: xs.Mesh) -> StackRecord:
  """Moves every parameter of `layers` into `container` (a copy of layer 0's structure, off the
  layers) as one stored stack, sharded on dim 0; registers it on `owner` right after the list,
  and the state-dict hooks that keep per-layer keys. The layers keep their buffers."""
  store = attr + SUFFIX
  if store in owner._modules or hasattr(owner, store):
    raise ValueError(f"scan_layers: {type(owner).__name__} already has an attribute {store!r}, "
                     "where the stacked parameters of its layers would go")
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
    module, local = _locate(container, name)
    module._parameters[local] = param
    for layer in layers:
      module_i, _ = _locate(layer, name)
      del module_i._parameters[local]
  modules = list(owner._modules.items())
  owner._modules.clear()
  for key, value in modules:
    owner._modules[key] = value
    if key == attr:
      owner._modules[store] = container
  record = StackRecord(attr, len(layers), names, order)
  records = owner.__dict__.setdefault("_xla_fsdp_stacks", [])
  records.append(record)
  if len(records) == 1:
    owner._register_state_dict_hook(_per_layer_keys)
    owner._register_load_state_dict_pre_hook(_stack_on_load, with_module=True)
  _refuse_per_tensor_optimizers()
  return record


def _per_layer_keys(owner: nn.Module, state: Dict[str, torch.Tensor], prefix: str, _meta) -> None:
  """state_dict hook: the stored stacks become each layer's keys, where the layers' keys were."""
  if not stored_keys.wanted():
    stored_keys.split(owner._xla_fsdp_stacks, state, prefix)


def _stack_on_load(owner: nn.Module, state, prefix, _meta, _strict, _missing, _unexpected, errors) -> None:
  """load_state_dict pre-hook: each layer's keys are stacked into the stored parameter."""
  for record in owner._xla_fsdp_stacks:
    for name in record.names:
      keys = [f"{prefix}{record.attr}.{i}.{name}" for i in range(record.layers)]
      present = [k for k in keys if k in state]
      if len(present) == len(keys):
        state[f"{prefix}{record.store}.{name}"] = stored_keys.stack_layers([state.pop(k) for k in keys])
      elif present:
        errors.append(f"scan_layers: the state dict has {len(present)} of the {record.layers} layers' "
                      f"{prefix}{record.attr}.<i>.{name} (missing {sorted(set(keys) - set(present))[:3]}); "
                      "the stored stack is loaded whole")


# Optimizers that update every element from its own gradient and state only: on a stored
# stack they compute exactly what they compute per layer ([Note: parameters stored stacked]).
ELEMENTWISE = {
    "torch.optim.sgd.SGD", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW",
    "torch.optim.adamax.Adamax", "torch.optim.nadam.NAdam", "torch.optim.radam.RAdam",
    "torch.optim.adagrad.Adagrad", "torch.optim.rmsprop.RMSprop", "torch.optim.adadelta.Adadelta",
    "torch.optim.asgd.ASGD", "torch.optim.rprop.Rprop",
    "torch_xla.amp.syncfree.sgd.SGD", "torch_xla.amp.syncfree.adam.Adam",
    "torch_xla.amp.syncfree.adamw.AdamW",
}
_checked: "weakref.WeakSet" = weakref.WeakSet()
_hook = []


def _refuse_per_tensor_optimizers() -> None:
  if not _hook:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _hook.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer, _args, _kwargs) -> None:
  if optimizer in _checked:
    return
  kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
  stacked = any(getattr(p, "_xla_fsdp_stacked", False)
                for group in optimizer.param_groups for p in group["params"])
  if stacked and kind not in ELEMENTWISE:
    raise TypeError(
        f"scan_layers stores each parameter of the scanned layers stacked, and {kind} is not an "
        "element-wise optimizer xla_fsdp knows: per-tensor statistics (Adafactor's factored moments "
        "and update clipping, a trust ratio) would span every layer at once. Use "
        "scan_layers=\"per_step\" (fsdp_config \"scan_layers\": \"per_step\"), which keeps per-layer "
        "parameters, or an element-wise optimizer (SGD, Adam, AdamW, ...).")
  _checked.add(optimizer)
