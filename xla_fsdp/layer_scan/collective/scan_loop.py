"""Scanned layers on the collectives engine: one XLA While loop per pass, one layer ahead.

[Note: scanning units of the collectives engine]
With `scan_layers` a ModuleList of identical units runs as two While loops (forward, and backward with each layer
recomputed) built by collective_engine/region_loop.py, whose body is traced lazily: the body holds the engine's own
explicit collectives, as an unscanned unit's forward and backward do.

- Forward, trip i: the carry holds layer i's gathered parameters (compute dtype); the body runs the layer and gathers
  layer i+1's shards into the carry. The gather does not depend on the layer's compute, so they can run side by side
  (FSDP's forward prefetch, written into the loop).
- Backward, trip i (last layer first): the carry holds layer i's gathered parameters and the gradient of its output; the
  body recomputes the layer from its saved input, takes the gradients (`torch.autograd.grad`), reduce-scatters the
  parameters' gradients with the unit's own buckets and gathers layer i-1's shards into the carry.
- A chip holds two layers' full parameters at a time, as with prefetch. The trip after the last (before the first)
  gathers a layer it does not use: one layer's gather bytes per pass more than unscanned.
- The loop reads its layers' shards from one stack per parameter in the compute dtype, made when each loop starts: on
  the single controller a view of the stored stack ([Note: the collectives engine's stored stacks] in
  stacked_units.py), whose gradient leaves the backward loop as one stack; with one process per device or "per_step"
  the layers' own parameters, stacked (and their gradients sliced back) every step.
- Each layer is recomputed in backward: scan needs activation checkpointing on the scanned units
  (`activation_checkpointing=True`, fsdp_config `xla_fsdp_grad_ckpt`), and refuses without it.
- Dropout inside the loop draws its masks from a key per layer and sequence ([Note: dropout under scan] in
  layer_scan/keyed_random.py), so a recomputed layer draws the mask its forward drew.
- `Collectives.loop_body` starts each body from a fresh token and puts the one outside back: the program after the
  loop must not read a body value as torch_xla's collective token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from xla_fsdp.unit_state import state_of
from xla_fsdp.collective_engine.param_group import FSDPParamGroup
from xla_fsdp.collective_engine.precision import cast_inputs
from xla_fsdp.memory import host_offload
from xla_fsdp.memory.remat_policy import note_applied, policy_of, saved_modules
from xla_fsdp.memory.saved_outputs import capturing, substituting

# (full parameters by site name, buffers by name, hidden, key, the other tensors) -> hidden output
LayerCall = Callable[[Dict[str, torch.Tensor], Dict[str, torch.Tensor], torch.Tensor, torch.Tensor,
                      Sequence[torch.Tensor]], torch.Tensor]


@dataclass
class _Plan:
    call: LayerCall
    group: FSDPParamGroup  # layer 0's: sizes, buckets and collectives, alike for every layer
    site_names: List[List[str]]  # per parameter of the group, the names it has in the layer
    layers: int
    compute_dtype: Optional[torch.dtype]
    mesh: Any  # the single controller's (None with one process per device)
    stored: bool  # the shards are one stored stack per parameter ([Note: the collectives engine's stored stacks])
    saves: List[nn.Module]  # the template's modules whose outputs the policy saves ([Note: saved outputs])
    offload: bool  # what a layer saves waits in host memory ([Note: host offload])


def _check_run(layers, states, where: str) -> None:
    """What can change after wrapping, checked when the loop runs."""
    for index, state in enumerate(states):
        if not state.checkpointed or state.keeps_activations:
            raise ValueError(
                f"scan_layers: layer {index} of {where} keeps its activations for backward; the "
                "collectives engine's scanned loop recomputes every layer. Turn on activation "
                "checkpointing for the layers (activation_checkpointing=True, fsdp_config "
                "\"xla_fsdp_grad_ckpt\": true; no checkpoint_all_but_last) or turn scan_layers off.")
        if policy_of(layers[index]).name == "fit":
            raise ValueError(f"scan_layers: layer {index} of {where} has remat_policy=\"fit\", which chooses per "
                             "unit; the scanned layers run one program and share one policy. Name a policy "
                             "(e.g. \"save_dot_except_mlp\") or turn scan_layers off.")
        if policy_of(layers[index]).keeps_all:
            raise ValueError(f"scan_layers: layer {index} of {where} has remat_policy=\"none\" (keep every "
                             "activation); the collectives engine's scanned loop recomputes every layer. Give a "
                             "policy that recomputes (\"minimal\" saves every matmul) or turn scan_layers off.")
        group = state.group
        if not group.requires_grad_sync or group.pending:
            raise RuntimeError(
                f"scan_layers: gradient sync is off (no_sync / set_requires_gradient_sync(False)) for "
                f"layer {index} of {where}; the scanned loop reduce-scatters every step. Accumulate "
                "with synced micro-batches, or turn scan_layers off.")
        if state.unsharded is not None:
            raise RuntimeError(f"scan_layers: layer {index} of {where} is unsharded (unshard() or "
                               "summon_full_params()); call reshard() first.")
        if group.grad_factor != states[0].group.grad_factor:
            raise ValueError(f"scan_layers: layer {index} of {where} has its own gradient divide factor; "
                             "set one for every scanned layer alike.")


def _cast(plan: _Plan, t: torch.Tensor) -> torch.Tensor:
    return t.to(plan.compute_dtype) if plan.compute_dtype is not None and t.is_floating_point() else t


def _stack(plan: _Plan, shards: Sequence[torch.Tensor], order: Sequence[int]) -> List[torch.Tensor]:
    """Per parameter, (layers, *shard) of the layers in `order`, in the compute dtype."""
    count = len(plan.group.params)
    with torch.no_grad():
        return [torch.stack([_cast(plan, shards[layer * count + j].detach()) for layer in order]) for j in range(count)]


def _layer_views(plan: _Plan, stacks: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Per stored stack (this device's (rows, L, *rest)), its layers as (L, rows, *rest) in the compute dtype."""
    with torch.no_grad():
        return [_cast(plan, s.detach().movedim(1, 0)) for s in stacks]


def _gather(plan: _Plan, shards: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return plan.group.gather(shards=list(shards))


def _named(plan: _Plan, full: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {name: t for names, t in zip(plan.site_names, full) for name in names}


def _loop(trip, carry, xs: tuple, mesh, reverse: bool = False, shift=(0, 0)):
    """`region_loop.while_loop` on pytrees: (final carry, stacked ys). `shift`: (position in `xs`,
    k): trip i reads slice i + k (mod the trips) of that entry's tensors in place."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from xla_fsdp.collective_engine.region_loop import while_loop

    flat_carry, carry_tree = tree_flatten(carry)
    flat_xs, xs_tree = tree_flatten(xs)
    shifts = [shift[1] if i == shift[0] else 0 for i, x in enumerate(xs) for _ in tree_flatten(x)[0]]
    ys_tree = []

    def body(c, x):
        out_carry, y = trip(tree_unflatten(c, carry_tree), tree_unflatten(x, xs_tree))
        flat_y, tree = tree_flatten(y)
        ys_tree.append(tree)
        return tree_flatten(out_carry)[0], flat_y

    final, ys = while_loop(body, flat_carry, flat_xs, mesh, reverse, shifts)
    return tree_unflatten(final, carry_tree), tree_unflatten(ys, ys_tree[0])


class _ScannedUnits(torch.autograd.Function):

    @staticmethod
    def forward(ctx, plan: _Plan, count_rest: int, hidden: torch.Tensor, keys: torch.Tensor,
                buffers: Dict[str, torch.Tensor], *flat: torch.Tensor) -> torch.Tensor:
        rest, shards = list(flat[:count_rest]), flat[count_rest:]
        count, layers = len(plan.group.params), plan.layers

        comm = plan.group.comm

        def trip(carry, x):
            h, full, kept, consts = carry
            key, following, bufs = x
            with comm.loop_body(consts):
                with capturing(plan.saves) as outputs:
                    out = plan.call(_named(plan, full), bufs, h, key, kept)
                nxt = _gather(plan, comm.optimization_barrier(following))  # [Note: a trip's slice, held]
            saved = [h, *outputs]
            if plan.offload:
                saved = [host_offload.to_host(t) for t in saved]
            return (out, nxt, kept, consts), saved

        if plan.stored:  # trip i gathers layer i + 1
            first = _gather(plan, [s.detach().select(1, 0) for s in shards])  # not through the transpose
            ahead, shift = _layer_views(plan, shards), 1
        else:
            first = _gather(plan, [s.detach() for s in shards[:count]])
            ahead, shift = _stack(plan, shards, [(i + 1) % layers for i in range(layers)]), 0
        (out, _, _, _), inputs = _loop(trip, (hidden.detach(), first, rest, comm.loop_constants()),
                                       (keys, ahead, buffers), plan.mesh, shift=(1, shift))
        ctx.plan, ctx.count_rest, ctx.buffers, ctx.count_saved = plan, count_rest, buffers, len(inputs)
        ctx.save_for_backward(*inputs, keys, *flat)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        plan = ctx.plan
        inputs, (keys, *flat) = ctx.saved_tensors[:ctx.count_saved], ctx.saved_tensors[ctx.count_saved:]
        rest, shards = list(flat[:ctx.count_rest]), flat[ctx.count_rest:]
        params = plan.group.params
        count, layers = len(params), plan.layers
        trained = [j for j, p in enumerate(params) if p.requires_grad]

        comm = plan.group.comm

        def trip(carry, x):
            g, full, kept, consts = carry
            saved, key, previous, bufs = x
            if plan.offload:
                saved = [host_offload.to_device(t) for t in saved]
            h, outputs = saved[0], saved[1:]
            with torch.enable_grad():
                h = h.detach().requires_grad_(True)
                leaves = [t.detach().requires_grad_(j in trained) for j, t in enumerate(full)]
                with substituting(plan.saves, outputs):
                    out = plan.call(_named(plan, leaves), bufs, h, key, kept)
                wrt = [h] + [leaves[j] for j in trained]
                grads = torch.autograd.grad(out, wrt, g, allow_unused=True)
            grad_in = torch.zeros_like(h) if grads[0] is None else grads[0]
            full_grads: List[Optional[torch.Tensor]] = [None] * count
            for j, d in zip(trained, grads[1:]):
                full_grads[j] = d
            with comm.loop_body(consts):
                reduced = plan.group.reduce_grads(full_grads)
                nxt = _gather(plan, comm.optimization_barrier(previous))
            return (grad_in.to(g.dtype), nxt, kept, consts), [reduced[j] for j in trained]

        if plan.stored:  # trip i gathers layer i - 1
            last = _gather(plan, [s.detach().select(1, layers - 1) for s in shards])
            behind, shift = _layer_views(plan, shards), -1
        else:
            last = _gather(plan, [s.detach() for s in shards[(layers - 1) * count:]])
            behind, shift = _stack(plan, shards, [(i - 1) % layers for i in range(layers)]), 0
        (grad_in, _, _, _), reduced = _loop(trip, (grad_out.detach(), last, rest, comm.loop_constants()),
                                         (list(inputs), keys, behind, ctx.buffers), plan.mesh, reverse=True,
                                         shift=(2, shift))
        shard_grads: List[Optional[torch.Tensor]] = [None] * (count if plan.stored else count * layers)
        for k, j in enumerate(trained):
            if plan.stored:  # (L, rows, *rest) -> the stored stack's (rows, L, *rest)
                shard_grads[j] = reduced[k].movedim(0, 1)
                continue
            for layer, g in enumerate(reduced[k].unbind(0)):
                shard_grads[layer * count + j] = g
        ctx.plan = ctx.buffers = None  # the layer's call holds the model's other arguments
        return (None, None, grad_in, None, None, *([None] * ctx.count_rest), *shard_grads)


def run_loop(scan_run, args: tuple, kwargs: dict) -> Any:
    """The model's call of its first scanned layer: every layer, as two loops. `scan_run` is the
    pass of a ScannedLayers (layer_scan/scanned_list.py: ScanRun)."""
    from torch.utils._pytree import tree_unflatten

    from xla_fsdp.layer_scan.keyed_random import KeyedRandom, layer_keys

    owner, layers = scan_run.owner, scan_run.layers
    where = owner._scan_where
    states = [state_of(layer) for layer in layers]
    _check_run(layers, states, where)
    group = states[0].group
    stack = _stack_state(scan_run.owner, len(layers))
    if stack is not None:  # [Note: the collectives engine's stored stacks]
        group = stack.loop_group
        group.grad_factor = stack.group.grad_factor
    policy = policy_of(layers[0])  # [Note: recomputation policies]
    note_applied(layers, policy, "scanned")
    mp = states[0].options.mixed_precision
    if mp.enabled:  # [Note: every unit casts its own inputs]
        args, kwargs = cast_inputs(mp, args, kwargs)
    others, tree = scan_run.other_arguments(args, kwargs)
    slots = [i for i, t in enumerate(others) if isinstance(t, torch.Tensor)]
    template = owner.template()
    shape_out: List[Any] = []

    def call(params, bufs, h, key, kept):
        leaves = list(others)
        for i, t in zip(slots, kept):
            leaves[i] = t
        rest, named = tree_unflatten(leaves, tree)
        with KeyedRandom(key, where):
            out = torch.func.functional_call(template, {**params, **bufs}, (h,) + tuple(rest), named,
                                             strict=True)
        if not shape_out:  # what the layer returns, without keeping traced tensors alive
            shape_out.append(_stand_in(out))
        return out if isinstance(out, torch.Tensor) else out[0]

    buffers = {name: torch.stack([layer.get_buffer(name) for layer in layers])
               for name, _ in layers[0].named_buffers()}
    hidden = args[0]
    plan = _Plan(call=call, group=group, site_names=[[s.fqn for s in p.sites] for p in group.params],
                 layers=len(layers), compute_dtype=mp.compute_dtype if mp.enabled else None,
                 mesh=group.comm.placement.mesh if group.comm.is_single_controller else None,
                 stored=stack is not None, saves=saved_modules(template, policy, where), offload=policy.offload)
    if stack is not None:
        shards = stack.group.local_shards(grad=True)
    else:
        shards = [s for st in states for s in st.group.local_shards(grad=True)]
    keys = layer_keys(len(layers), hidden)
    final = _ScannedUnits.apply(plan, len(slots), hidden, keys, buffers, *[others[i] for i in slots], *shards)
    return scan_run.shaped(final, shape_out[0])


def _stack_state(owner, layers: int):
    """The unit state of the stored stacks this ScannedLayers reads, None without stored stacks."""
    if not owner._scan_store:
        return None
    state = state_of(owner._scan_store[0])
    if owner._scan_rows != (0, layers) or state.group.params[0].row_shape[0] != layers:
        raise ValueError(f"scan_layers: the model runs layers {owner._scan_rows[0]} to {owner._scan_rows[1]} of "
                         f"{owner._scan_where}, a part of the stored stacks; the collectives engine's loop runs "
                         "them whole. Use scan_layers=\"per_step\".")
    if state.unsharded is not None:
        raise RuntimeError(f"scan_layers: the stored stacks of {owner._scan_where} are unsharded (unshard() or "
                           "summon_full_params()); call reshard() first.")
    return state


def _stand_in(out: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: torch.empty(0) if isinstance(t, torch.Tensor) else t, out)
