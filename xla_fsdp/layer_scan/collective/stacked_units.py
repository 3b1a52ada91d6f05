"""Scanned units' shards stored stacked on the collectives engine (single controller).

[Note: the collectives engine's stored stacks]
Stacking every layer's shard when each loop starts and slicing the reduced gradients back per layer leaves an O(depth)
part in the step's program: a cast and a copy per layer and parameter before each loop, a slice per layer after
backward, and the clipping norm and optimizer update once per layer and parameter. So on the single controller
`scan_layers=True` stores each parameter of the scanned layers once, as the SPMD engine does ([Note: parameters stored
stacked]) (docs/scan.md measures both).

- Layout: layer i's parameter (d0, *rest) is column i of the stored (d0, L, *rest), sharded on dim 0 with the layer's
  own rows per shard (its padding and [Note: shards in whole tiles] included). A device's piece is (rows_per_rank, L,
  *rest); its `movedim(1, 0)` is the stack the loop slices, each slice exactly the layer's own shard, so the loop's
  gathers and reduce-scatters are the per-layer ones ([Note: scanning units of the collectives engine]).
- The stacks live on `<list>_scan` (a copy of one layer's modules, no buffers), right after the list; it is a unit of
  its own (a group of the stacked records, never run), so the state-dict, checkpoint, clipping and region code see its
  parameters as any unit's. The layers stay units with empty groups (their checkpointing, prefetch and sync switches),
  and layer 0's records, without storage, give the loop its sizes and buckets.
- State dicts and optimizers see the stacks as on the SPMD engine ([Note: parameters stored stacked]; "per_step" keeps
  per-layer parameters for the optimizers refused there).
- One process per device keeps per-layer parameters (stacked every step): its per-rank state dicts and shard metadata
  are per layer.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn

from xla_fsdp import abstract
from xla_fsdp.layer_scan.stored_stacks import StackRecord, attach, check_store_name, locate
from xla_fsdp.unit_state import register, state_of
from xla_fsdp.collective_engine.param import FSDPParam, ParamSite
from xla_fsdp.collective_engine.param_group import FSDPParamGroup


def refuse_unstackable(layers: Sequence[nn.Module], where: str) -> None:
    """What stored stacks cannot hold, refused at wrap time with the way out (weights shared inside or across layers:
    layer_scan.stored_stacks.check_shared)."""
    for rec in state_of(layers[0]).group.params:
        if not rec.orig_shape:
            raise ValueError(f"scan_layers: {where}.0.{rec.fqn} is a 0-dim parameter; stored stacks keep "
                             "dim 0 as the parameter's rows. Use scan_layers=\"per_step\".")


def _stacked_data(per_layer: List[FSDPParam], comm) -> torch.Tensor:
    """The layers' global shards as one (padded_rows, L, *rest) tensor sharded on dim 0."""
    first = per_layer[0]
    shape = (first.padded_rows, len(per_layer), *first.row_shape)
    spec = comm.placement.spec("param", len(shape))
    if abstract.active():  # placeholders, not an op of the traced step ([Note: abstract tracing])
        return abstract.placeholder(shape, first.orig_dtype, comm.placement.mesh.get_op_sharding(spec))
    import torch_xla.distributed.spmd as xs

    with torch.no_grad():
        data = torch.stack([p.sharded.detach() for p in per_layer], dim=1)
    xs.mark_sharding(data, comm.placement.mesh, spec)
    return data


def store(owner: nn.Module, attr: str, layers: Sequence[nn.Module], container: nn.Module):
    """Moves the shards of `layers` (units) into `container` (a hook-free copy of layer 0) as stored stacks; returns
    the container's unit state, whose `loop_group` holds layer 0's records."""
    from xla_fsdp.collective_engine.model_state import register as register_padding
    from xla_fsdp.collective_engine.state import FSDPState

    check_store_name(owner, attr)
    states = [state_of(layer) for layer in layers]
    first = states[0]
    comm, options = first.group.comm, first.options
    for module in container.modules():  # the layers keep their buffers
        module._buffers.clear()
        module._non_persistent_buffers_set.clear()
    records = []
    for j, rec in enumerate(first.group.params):
        per_layer = [st.group.params[j] for st in states]
        site = ParamSite(*locate(container, rec.fqn), rec.fqn)
        stacked = FSDPParam.stack_of(per_layer, [site], _stacked_data(per_layer, comm))
        stacked.sharded._xla_fsdp_stacked = True
        stacked.register(stacked.sharded)
        records.append(stacked)
    comm.sync([r.sharded for r in records])
    order = list(layers[0].state_dict(keep_vars=True).keys())
    for st in states:  # the layers hold no parameters now
        for rec in st.group.params:
            for s in rec.sites:
                del s.module._parameters[s.name]
            rec.sharded = None
    loop_group = FSDPParamGroup(first.group.params, comm, options)
    for st in states:
        st.group.params, st.group.gather_buckets, st.group.reduce_buckets = [], [], []
    group = FSDPParamGroup(records, comm, options)
    state = FSDPState(container, group, options)
    state.device_mesh = first.device_mesh
    state.loop_group = loop_group
    register(container, state)
    register_padding(group)
    attach(owner, attr, container, StackRecord(attr, len(layers), [r.fqn for r in records], order))
    return state


def template_with(make, records: Sequence[FSDPParam]):
    """`make` (layer 0 -> the loop's template) whose template gets meta parameters in place of the ones layer 0 no
    longer holds (what `functional_call` replaces)."""
    def made(layer: nn.Module) -> nn.Module:
        template = make(layer)
        for rec in records:
            module, local = locate(template, rec.fqn)
            module._parameters[local] = nn.Parameter(
                torch.empty(rec.orig_shape, dtype=rec.orig_dtype, device="meta"), rec.requires_grad)
        return template
    return made


def layer_params(scanned, index: int):
    """Layer `index`'s parameters by name, for a call with a KV cache (generation), which runs the layers one by one:
    gathered from its column of the stored stacks in the compute dtype, as its own unit would gather them; the whole
    stacks' column while they are unsharded (summon_full_params)."""
    state = state_of(scanned._scan_store[0])
    loop = state.loop_group
    if state.unsharded is not None:
        return {rec.fqn: t.select(1, index) for rec, t in zip(loop.params, state.unsharded)}
    shards = [s.select(1, index) for s in state.group.local_shards()]
    return {rec.fqn: t for rec, t in zip(loop.params, loop.gather(shards=shards))}
