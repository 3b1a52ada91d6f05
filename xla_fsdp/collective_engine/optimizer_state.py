"""Optimizer state dicts of the collective engine's parameters, and loads that keep the sharding.

[Note: optimizer state of the single controller] The optimizer holds the single controller's padded global tensors
([Note: state dicts of the single controller]), so its state is padded on dim 0 too (AdamW's moments of a (10, 16)
weight at 4 devices: (12, 16)). As `model.state_dict()` does, `optimizer.state_dict()` cuts the padding rows off: every
state tensor shaped like its padded parameter becomes the parameter's real rows in the unwrapped shape, a row factor
(Adafactor's `exp_avg_sq_row`) its real rows; the result loads into the unwrapped model's optimizer.
`optimizer.load_state_dict()` pads such tensors again and places them sharded as their parameter; a padded state (one
saved before) loads as it is. Other state is left as the optimizer keeps it, as checkpoints keep it: scalars, and
tensors computed over the padded parameter as a whole (Adafactor's column factor, a mean over the rows padding
included). For a 0-dim parameter (one row padded to one per device) a 0-dim state tensor is the parameter's, except the
counters named in SCALAR_STATE, which every shape of parameter has.

[Note: loaded optimizer state keeps the sharding] torch's `Optimizer.load_state_dict` moves every state tensor to its
parameter's device (`value.to(param.device)`): for a `fully_shard` parameter `xla:0`, so on every resume (through
`set_state_dict` or a plain `optimizer.load_state_dict`) an XLA tensor without sharding arrives, a replicated copy on
every device and a step that is no longer the one compiled. So such an optimizer gets a load post-hook that marks every
state tensor shaped like its parameter (the global, possibly padded shape) with that parameter's sharding (padded state
arrives padded and placed by the pre-hook above, and is left alone).

No hook reaches an optimizer at its construction, so one global optimizer-step pre-hook attaches them at the first step
of an optimizer holding such a parameter (`set_state_dict` makes one step to create the state before it loads). A state
loaded before that step (a resume) arrives unpadded or unsharded; torch_xla keeps such a freshly moved tensor on the
host until first used, so the same hook places it before the step reads it: no device holds an unsharded copy. Our own
checkpoints attach the hooks before they read or write (`prepare`), and read the padded tensors (`held_state_dict`).

`StateTensor`, the value both state dicts of a `fully_shard` model give, lives here (the lower of the two modules): on
several hosts the state tensors shaped like their parameter are StateTensors too, so DCP writes and reads each host's
rows of them ([Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py); on one host optimizer state dicts are as before.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .sharded_param import ShardedParameter, placements_on, stored_shape

ROW_FACTORED = ("exp_avg_sq_row",)  # one entry per row of the parameter (the rest averaged away)
SCALAR_STATE = ("step", "mu_product")  # torch's per-parameter counters: 0-dim whatever the parameter

_PADDED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # padded global parameter -> (record ref, comm)
_PREPARED: "weakref.WeakSet" = weakref.WeakSet()
_STEP_HOOK = []
_HELD = [0]  # > 0 while our checkpoints read the padded state


# -- the values state dicts give ([Note: loading into sharded parameters] in model_state.py) ---------
class StateTensor(torch.Tensor):
    """A state-dict value of a `fully_shard` model: a plain tensor with DTensor's `full_tensor()`,
    `to_local()`, `device_mesh` and `placements`, as FSDP2 scripts use them, and DCP's checkpoint
    protocol (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`). On one host
    DCP sees a plain tensor; on several the protocol is `host_chunks`'s: each host's chunks are the
    rows its own devices hold of `source` ([Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py)."""

    host_chunks = None  # xla_fsdp.fsdp.dcp.HostChunks, set by fully_shard (this layer cannot import it)

    @staticmethod
    def wrap(t: torch.Tensor, device_mesh, source: Optional[torch.Tensor] = None, rows: int = 0) -> "StateTensor":
        """`t` as a StateTensor; `source` is the global tensor whose first `rows` rows it is (padded
        on dim 0), for DCP on several hosts."""
        out = torch.Tensor._make_subclass(StateTensor, t, False)
        out.device_mesh = device_mesh
        out.source = source
        out.rows = rows
        out.dcp = None  # what host_chunks keeps between DCP's calls (pieces to write, rows read)
        return out

    @staticmethod
    def per_host() -> bool:
        """Whether DCP sees this host's rows (several hosts) rather than whole tensors."""
        return StateTensor.host_chunks is not None and StateTensor.host_chunks.active()

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _chunks(self):
        return StateTensor.host_chunks if getattr(self, "source", None) is not None and self.per_host() else None

    def has_loaded_rows(self) -> bool:
        """Whether `dcp.load` read this host's rows into this value (they take effect in a load)."""
        return getattr(self, "dcp", None) is not None and "read" in self.dcp

    def loaded(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The global tensor of `like`'s stored shape and sharding from the rows `dcp.load` read."""
        return StateTensor.host_chunks.loaded(self, like, dtype)

    def full_tensor(self) -> torch.Tensor:
        if self.has_loaded_rows():
            return self.loaded(self.source, self.dtype)[: self.rows].reshape(self.shape)
        return self.as_subclass(torch.Tensor)

    def to_local(self) -> torch.Tensor:
        return self.full_tensor()

    @property
    def placements(self):
        return placements_on(self.device_mesh)

    def __create_write_items__(self, fqn: str, obj):
        chunks = self._chunks()
        if chunks is None:
            from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

            return [_create_write_item_for_tensor(fqn, self)]
        return chunks.write_items(self, fqn)

    def __create_chunk_list__(self):
        chunks = self._chunks()
        if chunks is None:
            from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_tensor

            return [_create_chunk_from_tensor(self)]
        return chunks.chunk_list(self)

    def __get_tensor_shard__(self, index):
        chunks = self._chunks()
        return self if chunks is None else chunks.tensor_shard(self, index)

    def __reduce_ex__(self, proto):
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()

    def __repr__(self) -> str:
        return f"StateTensor(shape={tuple(self.shape)}, placements={self.placements}, device={self.device})"


def install() -> None:
    """The global optimizer-step pre-hook (once per process): a unit built over sharded parameters installs it."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(lambda opt, args, kwargs: prepare(opt)))  # every step


def register_padded(records, comm) -> None:
    """The single controller's padded parameters (`records` with padding rows) of one group."""
    for rec in records:
        _PADDED[rec.sharded] = (weakref.ref(rec), comm)
    install()


def _padded_params(optimizer) -> Dict[int, Tuple[torch.Tensor, object, object]]:
    """state_dict numbering -> (parameter, record, comm) for the optimizer's padded parameters."""
    out = {}
    for index, p in _params(optimizer).items():
        entry = _PADDED.get(p)
        rec = entry[0]() if entry is not None else None
        if rec is not None and rec.sharded is p:
            out[index] = (p, rec, entry[1])
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
        optimizer.register_state_dict_pre_hook(_placed_first)
        optimizer.register_state_dict_post_hook(_as_state_tensors)  # after _cut
        optimizer.register_load_state_dict_pre_hook(_take_loaded_rows, prepend=True)  # before _pad
        optimizer.register_load_state_dict_post_hook(shard_like_params)
        shard_like_params(optimizer)


def shard_like_params(optimizer) -> None:
    """Place each state tensor shaped like its (sharded) parameter but not sharded like it (a CPU tensor, an XLA
    tensor without sharding or replicated) sharded like the parameter."""
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


def held_state_dict(optimizer) -> dict:
    """`optimizer.state_dict()` as the optimizer holds it (the single controller's padded global tensors): what
    checkpoints write, row by row."""
    prepare(optimizer)
    _HELD[0] += 1
    try:
        return optimizer.state_dict()
    finally:
        _HELD[0] -= 1


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


def _params(optimizer) -> Dict[int, torch.Tensor]:
    """state_dict numbering -> parameter."""
    unique = {id(p): p for group in optimizer.param_groups for p in group["params"]}  # each at its first place
    return dict(enumerate(unique.values()))


def _placed_first(optimizer) -> None:
    """Several hosts: state not yet sharded like its parameter (a fresh optimizer's, made by
    `set_state_dict`'s first step) is placed so before DCP asks which rows each host holds."""
    if not _HELD[0] and StateTensor.per_host():
        shard_like_params(optimizer)


def _as_state_tensors(optimizer, state_dict) -> Optional[dict]:
    """On several hosts: state tensors shaped like their `fully_shard` parameter as `StateTensor`s
    of the optimizer's own (padded) tensors, so DCP writes and reads each host's rows ([Note: DCP
    across hosts] in xla_fsdp/fsdp/dcp.py). One host: nothing changes."""
    if _HELD[0] or not StateTensor.per_host():
        return None
    params = _params(optimizer)
    state = dict(state_dict["state"])
    for index, entry in state.items():
        p = params.get(index)
        if not isinstance(p, ShardedParameter):
            continue
        held = optimizer.state.get(p, {})
        rows = p.shape[0] if len(p.shape) else 1  # the parameter's own rows

        def wrapped(key, value):
            source = held.get(key)
            if (isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor) and source.dim()
                    and tuple(source.shape) == tuple(stored_shape(p))):
                return StateTensor.wrap(value.detach(), p.device_mesh, source, rows)
            return value
        state[index] = {k: wrapped(k, v) for k, v in entry.items()}
    return {**state_dict, "state": state}


def _take_loaded_rows(optimizer, state_dict) -> Optional[dict]:
    """State `dcp.load` read host by host becomes global tensors sharded like their parameter
    (stored shape: `_pad` and `shard_like_params` leave them alone); other `StateTensor`s plain."""
    if not any(isinstance(v, StateTensor) for entry in state_dict["state"].values() for v in entry.values()):
        return None
    params = _params(optimizer)
    keys = _saved_keys(optimizer, state_dict)
    state = dict(state_dict["state"])
    for key, entry in state.items():
        p = params.get(keys.get(key))

        def taken(value):
            if not isinstance(value, StateTensor):
                return value
            if value.has_loaded_rows() and p is not None:
                return value.loaded(p, p.dtype if value.is_floating_point() and p.is_floating_point() else value.dtype)
            return value.full_tensor()
        state[key] = {k: taken(v) for k, v in entry.items()}
    return {**state_dict, "state": state}


def _saved_keys(optimizer, state_dict) -> Dict[object, int]:
    """The loaded state's keys -> our numbering of the optimizer's parameters, paired as torch's `load_state_dict` pairs
    them (group by group, in order): the keys are numbers in `optimizer.state_dict()`, parameter names in
    torch.distributed.checkpoint's `get_state_dict` / `set_state_dict`."""
    out, index = {}, {id(p): i for i, p in _params(optimizer).items()}
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
    if (key in ROW_FACTORED and value.dim() == len(stored_shape(p)) - 1 and value.dim() >= 1
            and value.shape[0] == rec.rows and len(rec.orig_shape) > 1):
        rows = value.detach().cpu()  # (rows,) or, of a stored stack or a 3-dim parameter, (rows, ...)
        pad = rec.padded_rows - rec.rows
        return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]).to(p.device)  # replicated, as made
    return value
