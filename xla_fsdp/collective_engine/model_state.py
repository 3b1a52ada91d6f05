"""Model state dicts of the collective engine's units: keys, shapes, values and loads.

[Note: state dicts of the single controller] There each parameter is one global tensor padded on dim 0 to a multiple of
the sharding group size ([Note: dim-0 sharding]), and the optimizer holds that tensor, so it stays registered. A hook on
each module holding a padded parameter cuts the padding rows off in `state_dict()` (a view of the real rows) and
`load_state_dict()` pads a full tensor again before the usual in-place copy (which keeps the sharding); a padded tensor
still loads as it is. The hooks sit on the modules that own the parameters, so keys are those the module writes whatever
wrappers rename later, and hold the records weakly. With one process per device `state_dict()` stays each rank's shard,
described by `shard_metadata` (torch_xla's flow).

[Note: state-dict keys] A module's tree name is not always its state-dict prefix: torch's `CheckpointWrapper` /
`OffloadWrapper` register the wrapped module as `_checkpoint_wrapped_module` and strip that part from keys again.
`names(model)` mirrors `state_dict()`, and `check_against_state_dict` refuses, naming the key, anything that does not
match `model.state_dict()`'s keys.

[Note: loading into sharded parameters] A `fully_shard` unit's `state_dict()` values are `StateTensor`s (global
tensors with DTensor's surface: optimizer_state.py). Loading keeps every parameter a dim-0 sharded global tensor
whatever arrives: a CPU tensor is copied in place; an unsharded XLA tensor is copied, then marked sharded again;
`distribute_tensor(...)`'s XLAShardedTensor gives its global tensor; with `assign=True` each unit takes the assigned
tensor into its own sharded parameter afterwards (materializing a meta one). On several hosts a value `dcp.load` filled
host by host ([Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py) becomes its parameter's data, built from each host's
rows.

`check_load` is the one check of what is loaded against the model: every key one side lacks and every shape that
differs, in one message, before anything is written.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, Iterator, Mapping, Sequence, Tuple

import torch
import torch.nn as nn

from ..runtime import stored_keys
from ..unit_state import state_of, units
from . import optimizer_state
from .optimizer_state import StateTensor
from .param import FSDPParam
from .sharded_param import ShardedParameter, stored_shape

WRAPPED = "_checkpoint_wrapped_module"
SHARD_METADATA_FORMAT = "xla_fsdp.shard_metadata/1"


# -- the one load check -----------------------------------------------------------------------
def check_load(what: str, got: Mapping[str, Sequence[int]], want: Mapping[str, Sequence[Sequence[int]]],
               keys: bool = True) -> None:
    """Refuse loading `got` (key -> shape) into a model expecting `want` (key -> accepted shapes, the first the one to
    name): every missing and unexpected key (with `keys`) and every shape that differs, in one ValueError that ends
    "Nothing was loaded."."""
    missing, unexpected = (sorted(set(want) - set(got)), sorted(set(got) - set(want))) if keys else ([], [])
    parts = [f"{label} {names[:5]}{' ...' if len(names) > 5 else ''}"
             for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
    wrong = [f"{k!r} has shape {tuple(got[k])}, the model expects {tuple(shapes[0])}" for k, shapes in want.items()
             if k in got and tuple(got[k]) not in {tuple(s) for s in shapes}]
    parts += wrong[:5] + ([f"and {len(wrong) - 5} more shapes"] if len(wrong) > 5 else [])
    if parts:
        raise ValueError(f"{what} does not match the model: {'; '.join(parts)}. Nothing was loaded.")


# -- state-dict keys ([Note: state-dict keys]) -------------------------------------------------
def _drops_child_name(module: nn.Module, child: str) -> bool:
    """Whether `module`'s state_dict hook removes `child.` from its children's keys."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except Exception:  # torch built without torch.distributed
        return False
    return child == WRAPPED and isinstance(module, ActivationWrapper)


def _walk(module: nn.Module, tree: str, key: str) -> Iterator[Tuple[nn.Module, str, str]]:
    """(module, tree prefix, state-dict prefix) for `module` and everything under it (shared ones as often as they
    occur, like `named_parameters(remove_duplicate=False)`)."""
    yield module, tree, key
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, tree + name + ".", key if _drops_child_name(module, name) else key + name + ".")


def names(model: nn.Module) -> Dict[str, str]:
    """Tree name -> state-dict key, for every parameter and buffer (non-persistent ones included)."""
    return {tree + local: key + local for module, tree, key in _walk(model, "", "")
            for local, value in [*module._parameters.items(), *module._buffers.items()] if value is not None}


def key_of(table: Dict[str, str], tree_name: str) -> str:
    """The state-dict key of the parameter or buffer at `tree_name` (an error naming it if none)."""
    try:
        return table[tree_name]
    except KeyError:
        raise ValueError(f"{tree_name!r} is not a parameter or buffer of the model; its state-dict key is "
                         "unknown") from None


def buffers(model: nn.Module, persistent_only: bool = True) -> Dict[str, torch.Tensor]:
    """The buffers by state-dict key: those `model.state_dict()` holds, or with `persistent_only=False` those of
    `model.named_buffers()` (non-persistent ones too, a shared one once), renamed to keys."""
    if not persistent_only:
        table = names(model)
        return {key_of(table, name): b for name, b in model.named_buffers()}
    return {key + local: b for module, _, key in _walk(model, "", "") for local, b in module._buffers.items()
            if b is not None and local not in module._non_persistent_buffers_set}


def check_against_state_dict(model: nn.Module, keys: Iterable[str], what: str) -> list:
    """`model.state_dict()`'s keys, in order, after checking that `keys` are exactly those; an error naming every key
    that one side has and the other lacks (nothing is dropped silently)."""
    with stored_keys.stored_keys():  # stacked parameters as the model holds them (scan_layers)
        order = list(model.state_dict().keys())
    have = set(keys)
    missing = [k for k in order if k not in have]
    extra = sorted(have - set(order))
    parts = ([f"model.state_dict() has {missing} which {what} cannot produce (neither a sharded parameter nor a "
              "buffer; e.g. extra state or a key added by a state_dict hook)"] if missing else [])
    parts += [f"{what} has {extra} which model.state_dict() lacks (a wrapper renames keys in a way xla_fsdp does "
              "not know)"] if extra else []
    if parts:
        raise ValueError(f"{what}: keys do not match the model's state_dict(): {'; '.join(parts)}")
    return order


def unit_states(model: nn.Module) -> list:
    """The engine state of every unit under `model`, once each (a unit of several modules is one)."""
    return list({id(s): s for s in (state_of(u) for u in units(model))}.values())


def site_keys(model: nn.Module, rec, table: Dict[str, str], where: Dict[int, str]) -> list:
    """The state-dict keys of a record's sites ([Note: state-dict keys]); `where`: `module_names(model)`."""
    return [key_of(table, (where[id(site.module)] + "." if where[id(site.module)] else "") + site.name)
            for site in rec.sites]


def module_names(model: nn.Module) -> Dict[int, str]:
    """id(module) -> its first tree name in `model`."""
    return {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}


def records(model: nn.Module):
    """(state-dict keys, record, group) for every sharded parameter in the model, the keys checked against
    `model.state_dict()`'s."""
    table, where = names(model), module_names(model)
    out = [(site_keys(model, rec, table, where), rec, state.group) for state in unit_states(model)
           for rec in state.group.params]
    if not out:
        raise ValueError("the model has no XlaFullyShardedDataParallel units; use model.state_dict()")
    check_against_state_dict(model, [n for keys, _, _ in out for n in keys] + list(buffers(model)), "the sharded model")
    return out


# -- the single controller's padding ([Note: state dicts of the single controller]) ---------------
class _PaddedParams:
    """The padded global parameters of one module, by their name in it."""

    def __init__(self, by_name: Dict[str, FSDPParam]):
        self._records = {name: weakref.ref(rec) for name, rec in by_name.items()}

    def padded(self, module: nn.Module):
        """(name, record) for each parameter registered padded right now (not unsharded)."""
        for name, ref in self._records.items():
            rec = ref()
            if rec is not None and rec.sharded is not None and module._parameters.get(name) is rec.sharded:
                yield name, rec


class _CutPadding(_PaddedParams):
    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for name, rec in self.padded(module):
            if prefix + name in state_dict:
                state_dict[prefix + name] = state_dict[prefix + name][: rec.rows].reshape(rec.orig_shape)


class _PadAgain(_PaddedParams):
    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        for name, rec in self.padded(module):
            value = state_dict.get(prefix + name)
            # a ShardedParameter shows its own shape and pads in copy_; a plain one shows the padding
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(rec.orig_shape) \
                    and not isinstance(rec.sharded, ShardedParameter):
                state_dict[prefix + name] = rec.padded(value)


def is_padded(rec: FSDPParam) -> bool:
    return (rec.padded_rows, *rec.row_shape) != tuple(rec.orig_shape)


def register(group) -> None:
    """Hooks for every parameter of `group` (single-controller runtime) that has padding rows, and for the optimizers
    that will hold them ([Note: optimizer state of the single controller])."""
    by_module: Dict[int, tuple] = {}
    padded = [rec for rec in group.params if is_padded(rec)]
    for rec in padded:
        for site in rec.sites:
            by_module.setdefault(id(site.module), (site.module, {}))[1][site.name] = rec
    for module, by_name in by_module.values():
        module.register_state_dict_post_hook(_CutPadding(by_name))
        module.register_load_state_dict_pre_hook(_PadAgain(by_name))
    if padded:
        optimizer_state.register_padded(padded, group.comm)


# -- one process per device: what each rank's state_dict() holds ----------------------------------
def shard_metadata(root: nn.Module) -> Dict[str, Any]:
    """`model.get_shard_metadata()`: the record torch_xla's FSDP scripts save next to each rank's `state_dict()`, read
    back by `xla_fsdp.consolidate_sharded_model_checkpoints`. Its keys are the unwrapped model's (not torch_xla's
    `_fsdp_shard` names), so torch_xla's own consolidation fails on these files (no "flatten_info") instead of
    returning shards as whole parameters."""
    comm = state_of(root).group.comm
    layout = comm.layout
    single = comm.is_single_controller
    table, where = names(root), module_names(root)
    info: Dict[str, Any] = {}
    for state in unit_states(root):
        # the ranks whose shards make up one whole parameter: this unit's, which may differ from
        # the root's (a NO_SHARD unit nested in a FULL_SHARD root, or the reverse)
        group = [0] if single else list(state.group.comm.layout.shard_groups[0])
        for rec in state.group.params:
            keys = site_keys(root, rec, table, where)
            for name in keys:
                # one process holds every row on the single controller, unpadded in its state_dict()
                info[name] = {"shape": list(rec.orig_shape), "rows": rec.rows,
                              "rows_per_rank": rec.rows if single else rec.rows_per_rank,
                              "tied_to": keys[0] if name != keys[0] else None, "shard_group": group}
    held = buffers(root)
    check_against_state_dict(root, list(info) + list(held), "get_shard_metadata()")
    stacks = stored_keys.stack_table(root)  # scan_layers' stored stacks: state_dict() names each layer
    info = {layer: {**v, "shape": v["shape"][:1] + v["shape"][2:]} if k in stacks else v
            for k, v in info.items() for layer in stacks.get(k, [k])}
    return {
        "format": SHARD_METADATA_FORMAT,
        "world_size": 1 if single else layout.world_size,
        "rank": 0 if single else layout.rank,
        "shard_groups": [[0]] if single else [list(g) for g in layout.shard_groups],
        "shard_info": info,
        # a torch.dtype, as torch_xla writes it: its consolidation casts with it (a string failed there)
        "buffer_info": {name: {"_orig_dtype": b.dtype} for name, b in held.items()},
    }


# -- fully_shard units ([Note: loading into sharded parameters]) -----------------------------------
class _StateTensors:
    """state_dict post-hook of one fully_shard unit: the values of its parameters as `StateTensor`s."""

    def __init__(self, unit: nn.Module):
        self._unit = weakref.ref(unit)

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        unit = self._unit()
        if unit is None:
            return
        state = state_of(unit)
        params = {prefix + n for n, _ in module.named_parameters(remove_duplicate=False)}
        # several hosts: key -> (the global parameter, its rows) of those not unshard()ed, for DCP's per-host rows
        table = names(module) if StateTensor.per_host() else None
        sources = {} if table is None else {
            prefix + key_of(table, site.fqn): (rec.sharded, rec.rows) for rec in state.group.params
            for site in rec.sites if site.module._parameters.get(site.name) is rec.sharded}
        for key, value in list(state_dict.items()):
            if key in params and isinstance(value, torch.Tensor) and not isinstance(value, StateTensor):
                state_dict[key] = StateTensor.wrap(value.detach(), state.device_mesh, *sources.get(key, (None, 0)))


def register_state_tensors(unit: nn.Module) -> None:
    """The state-dict hook of one fully_shard unit (values as `StateTensor`s)."""
    unit.register_state_dict_post_hook(_StateTensors(unit))


def _global_value(value):
    """A loaded value as a plain tensor (see the note above)."""
    if isinstance(value, (StateTensor, ShardedParameter)):
        return value.detach().as_subclass(torch.Tensor)
    global_tensor = getattr(value, "global_tensor", None)  # torch_xla's XLAShardedTensor
    if isinstance(global_tensor, torch.Tensor):
        return global_tensor
    return value.full_tensor() if type(value).__name__ == "DTensor" and hasattr(value, "full_tensor") else value


def _loaded_rows(value) -> bool:
    return isinstance(value, StateTensor) and value.has_loaded_rows()


def _take_loaded_rows(root: nn.Module, values: dict) -> dict:
    """Values `dcp.load` read host by host ([Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py): each parameter takes the
    global tensor built from this host's rows as its data and is its own value (its copy_ onto itself does nothing); a
    key that is no parameter gets the tensor's real rows. Every host builds the same tensors in the same order."""
    loaded = [k for k, v in values.items() if _loaded_rows(v)]
    if not loaded:
        return values
    table = names(root)
    params = {table[n]: p for n, p in root.named_parameters(remove_duplicate=False)}
    values = dict(values)
    for key in loaded:
        p = params.get(key)
        if isinstance(p, ShardedParameter):
            with torch.no_grad():
                p.data = values[key].loaded(p, p.dtype)
            values[key] = p
        else:
            values[key] = values[key].full_tensor()
    return values


def load_into(root: nn.Module, state_dict, strict: bool, assign: bool):
    """`root.load_state_dict(...)` for a fully_shard module (see [Note: loading into sharded parameters])."""
    values = {k: _global_value(v) if isinstance(v, torch.Tensor) and not _loaded_rows(v) else v
              for k, v in state_dict.items()}
    want = {n: [tuple(p.shape), tuple(stored_shape(p))] for n, p in root.named_parameters()}
    check_load("load_state_dict", {k: v.shape for k, v in values.items() if isinstance(v, torch.Tensor)}, want,
               keys=False)
    sharded = units(root)
    specs = {id(rec): _sharding_spec(rec.sharded) for unit in sharded for rec in state_of(unit).group.params}
    result = nn.Module.load_state_dict(root, _take_loaded_rows(root, values), strict=strict, assign=assign)
    for unit in sharded:
        _adopt(unit, specs)
    return result


def _sharding_spec(t: torch.Tensor) -> str:
    if t.is_meta or t.device.type != "xla":
        return ""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def _adopt(unit, specs) -> None:
    """After a load: each record's sharded parameter holds the value registered in its place (assign=True put a new
    tensor there), sharded on dim 0 on the unit's devices. An in-place copy from an XLA tensor without sharding (or a
    replicated one: `set_state_dict` of a full state dict moves each value to the device whole), or DCP's in-place load
    into the unpadded view `state_dict()` gave of a padded parameter, leaves the parameter unsharded or replicated; it
    is placed again, through the host, sharded on dim 0."""
    import torch_xla

    state = state_of(unit)
    comm = state.group.comm
    for rec in state.group.params:
        site = rec.sites[0]
        current = site.module._parameters.get(site.name)
        if current is rec.sharded and not rec.sharded.is_meta:
            now = _sharding_spec(rec.sharded)
            if rec.sharded.device.type == "xla" and (not now or now != specs.get(id(rec), now)):
                with torch.no_grad():
                    rec.sharded.data = comm.place_global(rec.sharded.data.cpu())
            continue
        if current is None or current is rec.sharded:
            continue
        value = current.detach()
        if tuple(value.shape) == tuple(rec.orig_shape):
            value = rec.padded(value)
        data = comm.place_global(value.to(rec.orig_dtype).cpu() if value.device.type != "xla" else value)
        if torch_xla._XLAC._get_xla_sharding_spec(data) == "":
            import torch_xla.distributed.spmd as xs

            xs.mark_sharding(data, comm.placement.mesh, comm.placement.spec("param", data.dim()))
        was_meta = rec.sharded.is_meta
        rec.sharded = rec.param_cls(data, requires_grad=rec.requires_grad).bind(rec, state.device_mesh)
        rec.register(rec.sharded)
        if state.offload is not None:  # [Note: CPU offload on the single controller]
            state.offload.keep_on_host(rec, unit)
        if was_meta and is_padded(rec):
            optimizer_state.register_padded([rec], comm)
