"""Which ModuleLists the collectives engine scans, checked at wrap time, and their swap for a ScannedLayers run by the
loop of scan_loop.py ([Note: scanning units of the collectives engine])."""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from xla_fsdp.layer_scan.collective.scan_loop import run_loop
from xla_fsdp.unit_state import state_of


def unit_template(layer: nn.Module) -> nn.Module:
    """A hook-free copy of unit `layer` with meta tensors and its own class's forward (the engine's state stays on the
    real layer)."""
    from xla_fsdp.class_swap import original_class
    from xla_fsdp.layer_scan.find import _template
    from xla_fsdp.unit_state import _KEY

    state = layer.__dict__.pop(_KEY)
    cls = layer.__class__
    try:
        layer.__class__ = original_class(layer)
        return _template(layer)
    finally:
        layer.__class__ = cls
        layer.__dict__[_KEY] = state


def check_layers(layers: Sequence[nn.Module], where: str) -> None:
    """Refuses, with the reason, units the loop cannot run alike (at wrap time)."""
    from xla_fsdp.unit_state import units

    for index, layer in enumerate(layers):
        inner = [m for m in units(layer) if m is not layer]
        if inner:
            raise ValueError(f"scan_layers: layer {index} of {where} holds units of its own "
                             f"({type(inner[0]).__name__}); a scanned layer is gathered as one unit. Wrap "
                             "only the repeated layer class.")
        state = state_of(layer)
        if state.inner_forward is not None:
            raise ValueError(f"scan_layers: layer {index} of {where} runs another library's forward; the "
                             "loop runs the layer class's own forward. Turn scan_layers off.")
        if len(state.modules) > 1:
            raise ValueError(f"scan_layers: layer {index} of {where} shares its unit with other modules; "
                             "each scanned layer must be a unit of its own.")
    first = state_of(layers[0]).group
    for index, layer in enumerate(layers[1:], start=1):
        group = state_of(layer).group
        mine = [(p.orig_shape, p.orig_dtype, p.requires_grad, [s.fqn for s in p.sites]) for p in group.params]
        ref = [(p.orig_shape, p.orig_dtype, p.requires_grad, [s.fqn for s in p.sites]) for p in first.params]
        if mine != ref:
            raise ValueError(f"scan_layers: layer {index} of {where} shards different parameters than "
                             "layer 0 (names, shapes, dtypes or requires_grad); every scanned layer must "
                             "be identical. Turn scan_layers off for this model.")


def stores(mode, comm) -> bool:
    """Whether scan_layers=`mode` stores the shards stacked: True on the single controller; one process per device and
    "per_step" stack them every step."""
    return mode is True and comm.is_single_controller


def find(root: nn.Module, comm, mode=True):
    """The ModuleLists of `root` whose children are identical units, checked (before `install`), for stored stacks too
    where `mode` stores them."""
    from xla_fsdp.layer_scan.find import find_layer_lists
    from xla_fsdp.layer_scan.stored_stacks import check_shared
    from xla_fsdp.unit_state import units
    from xla_fsdp.layer_scan.collective.stacked_units import refuse_unstackable

    if not comm.is_xla:
        raise ValueError("scan_layers runs the layers as an XLA loop; this model's collectives are not "
                         "XLA's (torch.distributed on CPU tensors). Turn scan_layers off.")

    children = [m for m in units(root) if m is not root]
    found = find_layer_lists(root, children + [root])
    for _, _, layers, where in found:
        check_layers(layers, where)
        if stores(mode, comm):
            check_shared(root, layers, where)
            refuse_unstackable(layers, where)
    return found


def install(root: nn.Module, found, mode=True) -> None:
    """Swap each found ModuleList for a ScannedLayers run by this engine's loop; where `mode` stores them, its shards
    become stored stacks ([Note: the collectives engine's stored stacks])."""
    from xla_fsdp.layer_scan.scanned_list import ScannedLayers, ScanSettings, no_cache_by_default
    from xla_fsdp.layer_scan.collective.stacked_units import layer_params, store, template_with

    for owner, name, layers, where in found:
        # the template is made at the first call, from layer 0 as it is then: what was mixed into its modules after
        # wrapping (run_clm's head-major GPT-2 attention, [Note: head-major projections]) runs in the loop too
        settings = ScanSettings(run_loop, make_template=unit_template)
        container = None
        if stores(mode, state_of(layers[0]).group.comm):
            container = unit_template(layers[0])
            state = store(owner, name, layers, container)
            settings = ScanSettings(run_loop, layer_params=layer_params,
                                    make_template=template_with(unit_template, state.loop_group.params))
        scanned = ScannedLayers(layers, settings, where)
        setattr(owner, name, scanned)
        if container is not None:
            scanned._scan_store.append(container)
    no_cache_by_default(root)
    if type(root).__module__.startswith("transformers."):
        # without a cache transformers' mask code reads tensor values on the host, which the single controller's
        # region cannot; steered as enable() steers it for the Trainer
        from xla_fsdp.collective_engine.manual_region import steer_is_tracing

        steer_is_tracing()
