"""Scanned layers' parameters stored stacked: the record on the list's owner, its state-dict hooks and the
optimizer-step hooks both engines share ([Note: parameters stored stacked] in layer_scan/gspmd/stacked.py; the
collectives engine's layout in layer_scan/collective/stacked_units.py).

The owner of a scanned ModuleList `<attr>` holds a module `<attr>_scan` shaped like one layer, whose parameters are the
layers' parameters stacked on dim 1: (d0, L, *rest). Its `state_dict()` names each layer's slice as the unscanned model
does and `load_state_dict()` stacks those keys again (runtime/stored_keys.py), so checkpoints read and write either way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import List, Sequence

import torch.nn as nn

from xla_fsdp.layer_scan import stacked_adafactor
from xla_fsdp.runtime import stored_keys

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


def locate(root: nn.Module, dotted: str):
    """(the module holding `dotted`, the name there)."""
    owner_name, _, local = dotted.rpartition(".")
    return root.get_submodule(owner_name), local


def check_store_name(owner: nn.Module, attr: str) -> None:
    store = attr + SUFFIX
    if store in owner._modules or hasattr(owner, store):
        raise ValueError(f"scan_layers: {type(owner).__name__} already has an attribute {store!r}, "
                         "where the stacked parameters of its layers would go")


def check_shared(root: nn.Module, layers: Sequence[nn.Module], where: str) -> None:
    """Raises ValueError when the layers' parameters cannot be stored as one stack: shared between
    layers or with the rest of the model, or trainable in some layers only."""
    inside = {}
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            if id(p) in inside:
                raise ValueError(f"scan_layers: {where}.{index}.{name} is the same tensor as {inside[id(p)]}; shared "
                                 "weights cannot be stored stacked. Use scan_layers=\"per_step\" (stacks every step).")
            inside[id(p)] = f"{where}.{index}.{name}"
    owned = {id(p) for layer in layers for p in layer.parameters()}
    for name, p in root.named_parameters(remove_duplicate=False):
        if id(p) in owned and not any(name.startswith(f"{where}.{i}.") for i in range(len(layers))):
            raise ValueError(f"scan_layers: {name} is also a parameter of {where}; weights tied to a layer "
                             "cannot be stored stacked. Use scan_layers=\"per_step\" (stacks every step).")
    first = dict(layers[0].named_parameters())
    for index, layer in enumerate(layers[1:], start=1):
        for name, p in layer.named_parameters():
            if p.requires_grad != first[name].requires_grad:
                raise ValueError(
                    f"scan_layers: {where}.{index}.{name} has requires_grad={p.requires_grad} where layer 0 "
                    f"has {first[name].requires_grad}; a stored stack is trained whole. Freeze or train the "
                    "same parameters in every layer, or use scan_layers=\"per_step\"."
                )


def attach(owner: nn.Module, attr: str, container: nn.Module, record: StackRecord) -> None:
    """Registers `container` (the stored stacks) on `owner` right after the list, keeps `record`,
    and adds the state-dict hooks that keep per-layer keys (once per owner)."""
    modules = list(owner._modules.items())
    owner._modules.clear()
    for key, value in modules:
        owner._modules[key] = value
        if key == attr:
            owner._modules[record.store] = container
    records = owner.__dict__.setdefault("_xla_fsdp_stacks", [])
    records.append(record)
    if len(records) == 1:
        owner._register_state_dict_hook(_per_layer_keys)
        owner._register_load_state_dict_pre_hook(_stack_on_load, with_module=True)
    install_optimizer_hooks()


def _per_layer_keys(owner: nn.Module, state, prefix: str, _meta) -> None:
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


# Optimizers that update every element from its own gradient and state only: on a stored stack they compute exactly
# what they compute per layer ([Note: parameters stored stacked]). Hugging Face's Adafactor is run per layer ([Note:
# Adafactor on stored stacks]); others are refused.
ELEMENTWISE = {
    "torch.optim.sgd.SGD", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW", "torch.optim.adamax.Adamax",
    "torch.optim.nadam.NAdam", "torch.optim.radam.RAdam", "torch.optim.adagrad.Adagrad", "torch.optim.rmsprop.RMSprop",
    "torch.optim.adadelta.Adadelta", "torch.optim.asgd.ASGD", "torch.optim.rprop.Rprop",
    "torch_xla.amp.syncfree.sgd.SGD", "torch_xla.amp.syncfree.adam.Adam", "torch_xla.amp.syncfree.adamw.AdamW",
}
_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> runs stacks itself
_hidden: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> [(stack, grad)]
_hook = []


def install_optimizer_hooks() -> None:
    """The optimizer-step hooks (once per process): refuse what cannot run on stored stacks, run
    Adafactor per layer on them ([Note: Adafactor on stored stacks])."""
    if not _hook:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _hook.append(register_optimizer_step_pre_hook(_check_optimizer))
        _hook.append(register_optimizer_step_post_hook(_restore_gradients))


def _check_optimizer(optimizer, args, kwargs) -> None:
    if optimizer not in _checked:
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        stacked = any(getattr(p, "_xla_fsdp_stacked", False) for group in optimizer.param_groups
                      for p in group["params"])
        if stacked and kind not in ELEMENTWISE and kind != stacked_adafactor.KIND:
            raise TypeError(
                f"scan_layers stores each parameter of the scanned layers stacked, and {kind} is not an "
                "optimizer xla_fsdp can run on stacks: per-tensor statistics (a trust ratio, factored "
                "moments) would span every layer at once. Use scan_layers=\"per_step\" (fsdp_config "
                "\"scan_layers\": \"per_step\"), which keeps per-layer parameters, an element-wise optimizer "
                "(SGD, Adam, AdamW, ...) or transformers.optimization.Adafactor, which xla_fsdp runs per layer."
            )
        _checked[optimizer] = stacked and kind == stacked_adafactor.KIND
    if _checked[optimizer]:
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:  # args[0]: the optimizer
            raise TypeError("scan_layers: Adafactor's step on stored stacks takes no closure (the stacks are "
                            "updated from their gradients before Adafactor's own step runs); call loss.backward() "
                            "and then optimizer.step()")
        _hidden[optimizer] = stacked_adafactor.step_stacks(optimizer)


def _restore_gradients(optimizer, _args, _kwargs) -> None:
    """The stacks' gradients, hidden from Adafactor's own step ([Note: Adafactor on stored stacks])."""
    for p, grad in _hidden.pop(optimizer, ()):
        p.grad = grad
