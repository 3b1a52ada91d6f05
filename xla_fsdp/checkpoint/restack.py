"""A sharded checkpoint saved with scan_layers' stored stacks, loaded into a model without them, and the reverse.

[Note: loading across stored stacks] A model wrapped with scan_layers=True holds each parameter of its scanned layers
once, stacked (d0, L, *rest), or (L,) for a 0-dim one ([Note: parameters stored stacked]); its checkpoint stores that
tensor under the stack's name (`h_scan.attn.c_attn.weight`) and records which layer keys it holds (`meta["stacked"]`).
The unscanned model names the same numbers per layer (`h.3.attn.c_attn.weight`). Both are sharded on the same dim 0, so
rows [a, b) of layer i are rows [a, b) of the stack with layer i's column taken: loading either way is a renaming of
what is read, not another layout of the files:

- `plan` matches the checkpoint's names against the model's: a stack the model holds per layer ("split"), layers the
  model holds as a stack ("join"). A name matched neither way is left for load.py to refuse as another model's.
- `Restack.meta` is the checkpoint's metadata named the model's way, so load.py checks and builds everything as for any
  checkpoint. Per-parameter optimizer scalars (Adam's step) go to every layer from the stack, and come from the layers
  to the stack only when every layer holds the same value.
- `Restack.index` reads through the checkpoint's row index: a layer's rows out of the stack (each block of the stack
  read once for all L layers), a stack's rows from its layers.

Optimizer state that is not the parameter's rows (computed by a rank over its own shard, or an SPMD run's whole tensors
of such state) has no per-layer meaning in general, and is refused by name. The exception is Hugging Face's Adafactor,
run per layer on a stack ([Note: Adafactor on stored stacks]): its column factor and RMS hold the layers on dim 0 of an
SPMD run's whole tensor, so layer i takes row i of the stack's, and the layers' stack into one (`Restack.layers_first`,
`joined`, `values`)."""
from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..layer_scan import stacked_adafactor
from ..runtime import stored_keys
from .format import CheckpointError


@dataclass
class Restack:
    """How the checkpoint's names map onto the model's, and the metadata named the model's way."""

    split: Dict[str, Tuple[str, int]] = field(default_factory=dict)  # model's layer key -> (saved stack, layer)
    join: Dict[str, List[str]] = field(default_factory=dict)  # model's stack -> the saved layer keys
    meta: Dict[str, Any] = field(default_factory=dict)
    # `optim/NAME/STATE` keys (the model's names) of Adafactor state kept per layer on dim 0 of a stack
    layers_first: Dict[str, Tuple[str, int]] = field(default_factory=dict)  # layer's key -> (stack's key, layer)
    joined: Dict[str, List[Tuple[str, int]]] = field(default_factory=dict)  # stack's key -> the layers' (key, rows)
    values: Dict[str, torch.Tensor] = field(default_factory=dict)  # stack's key -> the layers' scalars

    def index(self, base) -> "RestackedIndex":
        return RestackedIndex(base, self)

    def same_group(self, mine: List[str], saved: List[str]) -> bool:
        """An optimizer group holds the same parameters (renamed here, so not in the same order)."""
        return sorted(mine) == sorted(saved)


def plan(meta: Dict[str, Any], names: List[str], model) -> Optional[Restack]:
    """The renaming that loads `meta`'s checkpoint into `model` (whose parameters' state-dict keys are `names`), or None
    when the two name their parameters alike."""
    saved = meta["params"]
    have = set(names)
    r = Restack()
    for stack, layers in meta.get("stacked", {}).items():
        if stack not in have and layers and all(k in have for k in layers):
            r.split.update({k: (stack, i) for i, k in enumerate(layers)})
    for stack, layers in stored_keys.stack_table(model).items():
        if stack not in saved and layers and all(k in saved for k in layers):
            r.join[stack] = list(layers)
    if not r.split and not r.join:
        return None
    r.meta = _renamed(meta, r)
    return r


def _renamed(meta: Dict[str, Any], r: Restack) -> Dict[str, Any]:
    out = copy.deepcopy(meta)
    params = out["params"]
    gone = set()
    for key, (stack, i) in r.split.items():
        params[key] = {**params[stack], "shape": layer_shape(params[stack]["shape"]), "aliases": []}
        gone.add(stack)
    for stack, layers in r.join.items():
        params[stack] = {**params[layers[0]], "shape": _stack_shape(params[layers[0]]["shape"], len(layers)),
                         "aliases": []}
        gone.update(layers)
    for name in gone:
        params.pop(name, None)
    out["stacked"] = {stack: layers for stack, layers in out.get("stacked", {}).items() if stack not in gone}
    optim = out.get("optimizer")
    if optim is not None:
        optim["state"] = _renamed_state(optim["state"], r, optim.get("class") == stacked_adafactor.KIND)
        for group in optim["param_groups"]:
            group["params"] = _renamed_group(group["params"], r)
    return out


def layer_shape(stack_shape: List[int]) -> List[int]:
    """A layer's shape from its stored stack's (d0, L, *rest) or (L,) (consolidate.py too)."""
    return [stack_shape[0], *stack_shape[2:]] if len(stack_shape) > 1 else []


def _stack_shape(layer_shape: List[int], layers: int) -> List[int]:
    return [layers] if not layer_shape else [layer_shape[0], layers, *layer_shape[1:]]


def _renamed_group(saved: List[str], r: Restack) -> List[str]:
    by_stack: Dict[str, List[str]] = {}
    for key, (stack, _) in r.split.items():
        by_stack.setdefault(stack, []).append(key)
    to_stack = {k: stack for stack, layers in r.join.items() for k in layers}
    out: List[str] = []
    for name in saved:
        if name in by_stack:
            out.extend(by_stack[name])
        elif name in to_stack:
            if to_stack[name] not in out:
                out.append(to_stack[name])
        else:
            out.append(name)
    return out


def _renamed_state(state: Dict[str, Dict[str, Any]], r: Restack, adafactor: bool) -> Dict[str, Dict[str, Any]]:
    out = dict(state)
    per_layer = stacked_adafactor.LAYERS_FIRST if adafactor else ()
    for key, (stack, i) in r.split.items():
        if stack in state:
            out[key] = {k: _layer_of_layers_first(r, key, stack, i, k, e) if k in per_layer else
                        _entry_for_layer(stack, k, e) for k, e in state[stack].items()}
    for stack, layers in r.join.items():
        held = [layer for layer in layers if layer in state]
        if not held:
            continue
        if len(held) != len(layers):
            raise CheckpointError(f"the checkpoint holds optimizer state for {len(held)} of the {len(layers)} layers "
                                  f"stacked as {stack!r} (none for {sorted(set(layers) - set(held))[:3]}); a stack's "
                                  "state is one tensor. Load it without the optimizer, or into the unscanned model")
        out[stack] = {k: _layers_first_of(r, stack, k, [state[layer].get(k) for layer in layers], layers)
                      if k in per_layer else _entry_for_stack(stack, k, [state[layer].get(k) for layer in layers], layers)
                      for k in state[layers[0]]}
    for name in {stack for stack, _ in r.split.values()} | {k for layers in r.join.values() for k in layers}:
        out.pop(name, None)
    return out


def _layer_of_layers_first(r: Restack, key: str, stack: str, i: int, state_key: str, entry: Dict[str, Any]):
    """Layer i's entry of a stack's Adafactor state kept per layer on dim 0 ([Note: Adafactor on stored stacks]): a
    global ("whole") (L, *rest) tensor, of which the layer takes [i]."""
    if entry["kind"] != "whole":
        _refuse_kind(stack, state_key, entry)
        return dict(entry)
    r.layers_first[f"optim/{key}/{state_key}"] = (f"optim/{stack}/{state_key}", i)
    return {**entry, "shape": list(entry["shape"][1:])}


def _layers_first_of(r: Restack, stack: str, state_key: str, entries, layers: List[str]) -> Dict[str, Any]:
    """The layers' entries of Adafactor state a stack keeps per layer on dim 0: the layers' global tensors, or their
    scalars (the RMS of each layer, saved as a number), stacked."""
    _check_layers(stack, state_key, entries, layers, ("whole", "scalar"))
    first = entries[0]
    key = f"optim/{stack}/{state_key}"
    if first["kind"] == "scalar":
        r.values[key] = torch.tensor([float(e["value"]) for e in entries], dtype=torch.float32)
        return {"kind": "whole", "shape": [len(layers)], "dtype": "float32"}
    r.joined[key] = [(f"optim/{layer}/{state_key}", e["shape"][0]) for layer, e in zip(layers, entries)]
    return {**first, "shape": [len(layers), *first["shape"]]}


def _refuse_kind(name: str, key: str, entry: Dict[str, Any]) -> None:
    if entry["kind"] not in ("rows", "scalar"):
        raise CheckpointError(
            f"the checkpoint's optimizer state {key!r} of {name!r} is not shaped like its parameter "
            f"({entry['kind']}: computed over a whole shard, e.g. Adafactor's column factor) and has no "
            "per-layer value between a stored stack and its layers; load into a model wrapped as when saving")


def _entry_for_layer(stack: str, key: str, entry: Dict[str, Any]) -> Dict[str, Any]:
    _refuse_kind(stack, key, entry)
    if entry["kind"] == "rows":
        return {**entry, "shape": layer_shape(entry["shape"])}
    return dict(entry)


def _check_layers(stack: str, key: str, entries: List[Optional[Dict[str, Any]]], layers: List[str],
                  allowed: Tuple[str, ...] = ()) -> None:
    """Every layer stacked as `stack` holds state `key`; a kind not `allowed` must pass `_refuse_kind`."""
    for layer, entry in zip(layers, entries):
        if entry is None:
            raise CheckpointError(f"the checkpoint's optimizer state {key!r} is missing for {layer!r} but held for "
                                  f"the other layers stacked as {stack!r}")
        if entry["kind"] not in allowed:
            _refuse_kind(layer, key, entry)


def _entry_for_stack(stack: str, key: str, entries: List[Optional[Dict[str, Any]]], layers: List[str]):
    _check_layers(stack, key, entries, layers)
    first = entries[0]
    if first["kind"] == "rows":
        return {**first, "shape": _stack_shape(first["shape"], len(layers))}
    values = {repr(e.get("value")) for e in entries}
    if len(values) > 1:
        raise CheckpointError(f"the checkpoint's optimizer state {key!r} differs between the layers stacked as "
                              f"{stack!r} ({sorted(values)[:3]}); a stack holds one value for all its layers. "
                              "Load it without the optimizer, or into the unscanned model")
    return dict(first)


class RestackedIndex:
    """The checkpoint's row index, read under the model's names (see the note above)."""

    def __init__(self, base, r: Restack):
        self.base = base
        self.r = r
        self._blocks: Dict[Tuple[str, int, int], List[Any]] = {}  # stack rows read, [tensor, layers left]
        self._layers = collections.Counter(stack for stack, _ in r.split.values())  # stack -> the layers split from it

    def _split(self, key: str):
        """(prefix, name, suffix) of `param/NAME` and `optim/NAME/STATE` keys."""
        kind, _, rest = key.partition("/")
        if kind in ("optim", "optim_rank"):
            name, _, state = rest.rpartition("/")
            return kind, name, "/" + state
        return kind, rest, ""

    def _sources(self, key: str) -> Optional[List[str]]:
        """The checkpoint's keys that `key` is read from (None: the layers' scalars kept in `values`)."""
        if key in self.r.layers_first:
            return [self.r.layers_first[key][0]]
        if key in self.r.values:
            return None
        if key in self.r.joined:
            return [k for k, _ in self.r.joined[key]]
        kind, name, suffix = self._split(key)
        if name in self.r.split:
            return [f"{kind}/{self.r.split[name][0]}{suffix}"]
        if name in self.r.join:
            return [f"{kind}/{k}{suffix}" for k in self.r.join[name]]
        return [key]

    def has(self, key: str) -> bool:
        sources = self._sources(key)
        return sources is None or all(self.base.has(k) for k in sources)

    def dtype_of(self, key: str) -> torch.dtype:
        sources = self._sources(key)
        return self.r.values[key].dtype if sources is None else self.base.dtype_of(sources[0])

    def read_rows(self, key: str, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        kind, name, suffix = self._split(key)
        if key in self.r.layers_first:  # row `layer` of the stack's (L, *rest): the layer's whole tensor
            stacked, layer = self.r.layers_first[key]
            value = self.base.read_rows(stacked, layer, layer + 1)[0]
            got = value[start:stop] if value.dim() else value.reshape(1)
        elif key in self.r.values:
            got = self.r.values[key][start:stop]
        elif key in self.r.joined:  # the stack's rows [start, stop) are layers: each one's whole tensor
            got = torch.stack([self.base.read_rows(k, 0, rows) for k, rows in self.r.joined[key][start:stop]])
        elif name in self.r.split:
            stack, layer = self.r.split[name]
            stacked = f"{kind}/{stack}{suffix}"
            if len(self.r.meta["params"][name]["shape"]) == 0:  # a 0-dim layer parameter: row `layer` of (L,)
                got = self.base.read_rows(stacked, layer, layer + 1)
            else:
                got = self._stack_block(stacked, start, stop, self._layers[stack])[:, layer].clone()
        elif name in self.r.join:
            layers = self.r.join[name]
            if len(self.r.meta["params"][name]["shape"]) == 1:  # 0-dim layers: rows of (L,) are layers
                got = torch.cat([self.base.read_rows(f"{kind}/{layers[i]}{suffix}", 0, 1) for i in range(start, stop)])
            else:
                got = stored_keys.stack_layers([self.base.read_rows(f"{kind}/{k}{suffix}", start, stop)
                                                for k in layers])
        else:
            return self.base.read_rows(key, start, stop, out=out)
        if out is not None:
            out.copy_(got)
            return out
        return got

    def _stack_block(self, key: str, start: int, stop: int, layers: int) -> torch.Tensor:
        """Rows [start, stop) of a stack, read once and kept until each of its layers took its column."""
        block = self._blocks.get((key, start, stop))
        if block is None:
            block = self._blocks[(key, start, stop)] = [self.base.read_rows(key, start, stop), layers]
        block[1] -= 1
        if block[1] <= 0:
            del self._blocks[(key, start, stop)]
        return block[0]

    def __getattr__(self, name: str):
        """`read_rank`, `ranks_with` and `open_all` as the checkpoint's own index (per-rank state is not renamed)."""
        return getattr(self.base, name)
