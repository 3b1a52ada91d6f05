"""`optimizer.state_dict()` / `load_state_dict()` in the unwrapped model's shapes, single-controller
runtime (the optimizer side of full_shapes.py).

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

No hook reaches an optimizer at its construction, so torch's global optimizer-step pre-hook
attaches the two hooks at the first step of an optimizer holding such a parameter. A state loaded
before that step (a resume) arrives unpadded; torch_xla keeps such a freshly moved tensor on the
host until it is first used, so the same hook pads and shards it before the step reads it: no
device ever holds an unsharded copy. Our own checkpoints attach the hooks before they read or
write (`prepare`), and read the padded tensors themselves (`held_state_dict`).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

ROW_FACTORED = ("exp_avg_sq_row",)  # one entry per row of the parameter (the rest averaged away)
SCALAR_STATE = ("step", "mu_product")  # torch's per-parameter counters: 0-dim whatever the parameter

_PADDED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # padded global parameter -> (record ref, comm)
_PREPARED: "weakref.WeakSet" = weakref.WeakSet()
_STEP_HOOK = None
_HELD = [0]  # > 0 while our checkpoints read the padded state


def register(records, comm) -> None:
    """The single controller's padded parameters (`records` with padding rows) of one group."""
    global _STEP_HOOK
    for rec in records:
        _PADDED[rec.sharded] = (weakref.ref(rec), comm)
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK = register_optimizer_step_pre_hook(_before_step)  # every optimizer's step


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
    """Attach the state-dict hooks to `optimizer` (once) and pad any state loaded before them."""
    if optimizer in _PREPARED:
        return
    _PREPARED.add(optimizer)
    if not _padded_params(optimizer):
        return
    optimizer.register_state_dict_post_hook(_cut)
    optimizer.register_load_state_dict_pre_hook(_pad)
    for p, rec, comm in _padded_params(optimizer).values():
        state = optimizer.state.get(p)
        if state:
            for key, value in list(state.items()):
                state[key] = _padded_value(key, value, p, rec, comm)


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
    if tuple(value.shape) == tuple(p.shape):
        return value[: rec.rows].reshape(rec.orig_shape)
    if key in ROW_FACTORED and value.dim() >= 1 and value.shape[0] == p.shape[0] and len(rec.orig_shape) > 1:
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
    if not isinstance(value, torch.Tensor) or tuple(value.shape) == tuple(p.shape):
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
