"""Optimizer state dicts of the collective engine's parameters, and loads that keep the sharding.

[Note: optimizer state of the single controller] The optimizer holds the single controller's
padded global tensors ([Note: state dicts of the single controller]), so its state is padded on
dim 0 too (AdamW's moments of a (10, 16) weight at 4 devices: (12, 16)). As `model.state_dict()`
does, `optimizer.state_dict()` cuts the padding rows off: every state tensor shaped like its
padded parameter becomes the parameter's real rows in the unwrapped shape, a row factor
(Adafactor's `exp_avg_sq_row`) its real rows; the result loads into the unwrapped model's
optimizer. `optimizer.load_state_dict()` pads such tensors again and places them sharded as
their parameter; a padded state (one saved before) loads as it is. Other state is left as the
optimizer keeps it, as checkpoints keep it: scalars, and tensors computed over the padded
parameter as a whole (Adafactor's column factor, a mean over the rows padding included). For a
0-dim parameter (one row padded to one per device) a 0-dim state tensor is the parameter's,
except the counters named in SCALAR_STATE, which every shape of parameter has.

[Note: loaded optimizer state keeps the sharding] torch's `Optimizer.load_state_dict` moves
every state tensor to its parameter's device (`value.to(param.device)`). For a `fully_shard`
parameter that is `xla:0`, and what arrives is an XLA tensor without sharding: a replicated
copy on every device, and a step that is no longer the one the model was compiled with. That
happens on every resume through `set_state_dict` or a plain `optimizer.load_state_dict`. So
such an optimizer gets a load post-hook that marks every state tensor shaped like its
parameter (the global, possibly padded shape) with that parameter's sharding (padded state
arrives padded and placed by the pre-hook above, and is left alone).

No hook reaches an optimizer at its construction, so one global optimizer-step pre-hook (the
only one) attaches these hooks at the first step of an optimizer holding such a parameter
(`set_state_dict` makes one step to create the state before it loads). A state loaded before
that step (a resume) arrives unpadded or unsharded; torch_xla keeps such a freshly moved tensor
on the host until it is first used, so the same hook places it before the step reads it: no
device ever holds an unsharded copy. Our own checkpoints attach the hooks before they read or
write (`prepare`), and read the padded tensors themselves (`held_state_dict`).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .sharded_param import ShardedParameter, stored_shape

ROW_FACTORED = ("exp_avg_sq_row",)  # one entry per row of the parameter (the rest averaged away)
SCALAR_STATE = ("step", "mu_product")  # torch's per-parameter counters: 0-dim whatever the parameter

_PADDED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # padded global parameter -> (record ref, comm)
_PREPARED: "weakref.WeakSet" = weakref.WeakSet()
_STEP_HOOK = []
_HELD = [0]  # > 0 while our checkpoints read the padded state


def install() -> None:
    """The global optimizer-step pre-hook (once per process): a unit built over sharded
    parameters installs it."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))  # every optimizer's step


def register_padded(records, comm) -> None:
    """The single controller's padded parameters (`records` with padding rows) of one group."""
    for rec in records:
        _PADDED[rec.sharded] = (weakref.ref(rec), comm)
    install()


def _before_step(optimizer, args, kwargs) -> None:
    if optimizer not in _PREPARED:
        prepare(optimizer)


def _padded_params(optimizer) -> Dict[int, Tuple[torch.Tensor, object, object]]:
    """state_dict numbering -> (parameter, record, comm) for the optimizer's padded parameters."""
    out, index, seen = {}, 0, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            entry = _PADDED.get(p)
            rec = entry[0]() if entry is not None else None
            if rec is not None and rec.sharded is p:
                out[index] = (p, rec, entry[1])
            index += 1
    return out


def prepare(optimizer) -> None:
    """Attach the state-dict hooks to `optimizer` (once) and place any state loaded before them."""
    if optimizer in _PREPARED:
        return
    _PREPARED.add(optimizer)
    padded = _padded_params(optimizer)
    if padded:
        optimizer.register_state_dict_post_hook(_cut)
        optimizer.register_load_state_dict_pre_hook(_pad)
        for p, rec, comm in padded.values():
            state = optimizer.state.get(p)
            if state:
                for key, value in list(state.items()):
                    state[key] = _padded_value(key, value, p, rec, comm)
    if any(isinstance(p, ShardedParameter) for g in optimizer.param_groups for p in g["params"]):
        optimizer.register_load_state_dict_post_hook(shard_like_params)
        shard_like_params(optimizer)


def shard_like_params(optimizer) -> None:
    """Place each state tensor shaped like its (sharded) parameter but not sharded like it
    (a CPU tensor, an XLA tensor without sharding or replicated) sharded like the parameter."""
    import torch_xla

    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or not isinstance(p, ShardedParameter) or p.device.type != "xla":
                continue
            spec = torch_xla._XLAC._get_xla_sharding_spec(p)
            if not spec:
                continue
            sharding = None
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(stored_shape(p)) or value.dim() == 0:
                    continue
                if value.device.type == "xla" and torch_xla._XLAC._get_xla_sharding_spec(value) == spec:
                    continue
                if sharding is None:
                    sharding = torch_xla._XLAC._get_xla_op_sharding(p)
                # through the host: a fresh copy, so no tensor keeps the replicated data
                placed = value.detach().cpu().to(dtype=p.dtype if value.is_floating_point() else value.dtype,
                                                 device=p.device)
                torch_xla._XLAC._xla_mark_sharding(placed, sharding)
                state[key] = placed


@contextlib.contextmanager
def _held():
    _HELD[0] += 1
    try:
        yield
    finally:
        _HELD[0] -= 1


def held_state_dict(optimizer) -> dict:
    """`optimizer.state_dict()` as the optimizer holds it (the single controller's padded global
    tensors): what checkpoints write, row by row."""
    prepare(optimizer)
    with _held():
        return optimizer.state_dict()


def _cut(optimizer, state_dict) -> Optional[dict]:
    if _HELD[0]:
        return None
    padded = _padded_params(optimizer)
    state = dict(state_dict["state"])
    for index, (p, rec, _) in padded.items():
        if index in state:
            state[index] = {k: _cut_value(k, v, p, rec) for k, v in state[index].items()}
    return {**state_dict, "state": state}


def _cut_value(key, value, p, rec):
    if not isinstance(value, torch.Tensor):
        return value
    if tuple(value.shape) == tuple(stored_shape(p)):
        return value[: rec.rows].reshape(rec.orig_shape)
    if key in ROW_FACTORED and value.dim() >= 1 and value.shape[0] == stored_shape(p)[0] and len(rec.orig_shape) > 1:
        return value[: rec.rows]
    return value


def _pad(optimizer, state_dict) -> Optional[dict]:
    padded = _padded_params(optimizer)
    state = dict(state_dict["state"])
    for key, index in _saved_keys(optimizer, state_dict).items():
        if key in state and index in padded:
            p, rec, comm = padded[index]
            state[key] = {k: _padded_value(k, v, p, rec, comm) for k, v in state[key].items()}
    return {**state_dict, "state": state}


def _saved_keys(optimizer, state_dict) -> Dict[object, int]:
    """The loaded state's keys -> our numbering of the optimizer's parameters, paired as
    torch's `load_state_dict` pairs them (group by group, in order): the keys are numbers in
    `optimizer.state_dict()`, parameter names in torch.distributed.checkpoint's
    `get_state_dict` / `set_state_dict`."""
    out, index, seen = {}, {}, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                index[id(p)] = len(seen)
                seen.add(id(p))
    for group, saved in zip(optimizer.param_groups, state_dict.get("param_groups", ())):
        for p, key in zip(group["params"], saved.get("params", ())):
            out.setdefault(key, index[id(p)])
    return out


def _padded_value(key, value, p, rec, comm):
    """A state value of padded parameter `p` in the unwrapped shape -> padded and placed as the
    optimizer holds it; anything else as it is."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) == tuple(stored_shape(p)):
        return value
    if tuple(value.shape) == tuple(rec.orig_shape) and not (value.dim() == 0 and key in SCALAR_STATE):
        rows = value.detach().cpu()  # torch_xla keeps a freshly moved tensor on the host: no device round trip
        if rows.is_floating_point() and p.is_floating_point():
            rows = rows.to(p.dtype)  # as torch's load_state_dict casts floating state
        return comm.place_global(rec.padded(rows))
    if key in ROW_FACTORED and value.dim() == 1 and value.shape[0] == rec.rows and len(rec.orig_shape) > 1:
        rows = value.detach().cpu()
        pad = rec.padded_rows - rec.rows
        return torch.cat([rows, rows.new_zeros(pad)]).to(p.device)  # replicated, as the optimizer makes it
    return value
