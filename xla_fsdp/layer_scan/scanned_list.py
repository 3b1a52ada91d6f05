"""Scan over a model's repeated layers (`scan_layers`): the ModuleList both engines run as a loop.

[Note: scanning the layers of a ModuleList]
A decoder calls its identical layers one after the other; traced lazily, every layer is a fresh copy of the same HLO, so
the program and its compile time grow with depth. Scanning runs the layers as XLA While loops, so the program holds one
layer's forward and one layer's backward. Each engine brings its loop (`ScanSettings.loop`): the SPMD engine's runs
torch_xla's `scan` over stacked parameters (layer_scan/gspmd/scan.py), the collectives engine's its own loops with
explicit collectives (layer_scan/collective/scan_loop.py).

Transformers' models (and most users' own) loop over an `nn.ModuleList` themselves, so the engine does not rewrite their
forward. It swaps the ModuleList for a `ScannedLayers` (same children, same state-dict keys: a checkpoint saved with
scan loads without it and the reverse). Iterating it hands out one stand-in per layer: the first stand-in's call runs
the whole loop with the arguments it was given (every layer of a decoder gets the same mask and positions) and returns
the last layer's output; each later stand-in checks that it got back exactly that output, unchanged, and returns it
again. A model that does anything to the hidden state between its layers fails that check loudly instead of computing
something else.

Where the loop cannot run as written it does not run: a call with a KV cache (generation) runs the real layers one by
one; hooks that transformers uses to collect per-layer outputs (`output_hidden_states`, `output_attentions`) and hooks
added to the layers after wrapping are refused with the reason, since a loop body cannot call them per layer.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .find import _hook_keys, _template

logger = logging.getLogger(__name__)

# (the pass, the first layer's positional and keyword arguments) -> the last layer's output
Loop = Callable[["ScanRun", Tuple, Dict[str, Any]], Any]


class ScanSettings:
    """What every scanned ModuleList of one model shares: the engine's loop, the compute dtype of stored stacks, and
    how a stored stack is viewed as (layers, ...) (engines that store none: None)."""

    def __init__(self, loop: Loop, compute_dtype: Optional[torch.dtype] = None,
                 stacked_view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 make_template: Callable[[nn.Module], nn.Module] = _template,
                 layer_params: Optional[Callable[["ScannedLayers", int], Dict[str, torch.Tensor]]] = None):
        self.loop = loop
        self.compute_dtype = compute_dtype
        self.stacked_view = stacked_view
        self.make_template = make_template  # layer 0 -> the module the loop body runs
        # (the list, layer i) -> layer i's parameters for a call with a KV cache, where the engine gathers them itself
        # (None: slices of the stored stacks in the compute dtype)
        self.layer_params = layer_params


class ScannedLayers(nn.ModuleList):
    """An `nn.ModuleList` whose iteration runs its layers as one While loop ([Note: scanning the layers of a
    ModuleList])."""

    def __init__(self, modules=None, settings: Optional[ScanSettings] = None, where: str = "layers", hooks=None):
        super().__init__(modules)
        self._scan_settings = settings
        self._scan_where = where
        # the hooks present at wrapping (the engine's); later ones are refused
        self._scan_hooks = _hook_keys(list(self)) if hooks is None else hooks
        self._scan_box: List[nn.Module] = []  # the template, off the module tree
        self._scan_store: List[nn.Module] = []  # the stored stacks' module (on the owner)
        self._scan_rows = (0, len(self))  # which layers of the stored stacks these are

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # `self.layers[:n]`, as Llama's loop writes it
            rows = range(*self._scan_rows)[idx]
            if rows.step != 1:
                raise ValueError(f"scan_layers: {self._scan_where}[{idx}] skips layers; a scanned "
                                 "list is run in order, whole or a contiguous part of it.")
            part = ScannedLayers(list(self._modules.values())[idx], self._scan_settings, self._scan_where,
                                 self._scan_hooks)
            part._scan_box = self._scan_box
            part._scan_store = self._scan_store
            part._scan_rows = (rows.start, rows.stop) if len(rows) else (0, 0)
            return part
        return super().__getitem__(idx)

    def stored(self) -> Dict[str, torch.Tensor]:
        """Each parameter name's stored stack as (layers, ...) for these layers (empty: per-step stacking)."""
        if not self._scan_store:
            return {}
        start, stop = self._scan_rows
        view = self._scan_settings.stacked_view
        return {name: view(p)[start:stop] for name, p in self._scan_store[0].named_parameters()}

    def __iter__(self):
        layers = list(self._modules.values())
        if self._scan_settings is None or len(layers) < 2:
            return iter(layers)
        run = ScanRun(self, layers)
        return iter([_Turn(run, i) for i in range(len(layers))])

    def template(self) -> nn.Module:
        if not self._scan_box:
            self._scan_box.append(self._scan_settings.make_template(next(iter(self._modules.values()))))
        return self._scan_box[0]


class _Turn:
    """Stands in for layer `index` in the model's loop."""

    def __init__(self, run: "ScanRun", index: int):
        self._run = run
        self._index = index

    def __getattr__(self, name: str) -> Any:  # attributes the loop reads
        return getattr(self._run.layers[self._index], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._index == 0:
            return self._run.start(args, kwargs)
        return self._run.follow(self._index, args)


class ScanRun:
    """One pass of the model's loop over a ScannedLayers."""

    def __init__(self, owner: ScannedLayers, layers: List[nn.Module]):
        self.owner = owner
        self.layers = layers
        self.output: Any = None

    def _hidden(self, output: Any) -> torch.Tensor:
        return output if isinstance(output, torch.Tensor) else output[0]

    def other_arguments(self, args: Tuple, kwargs: Dict[str, Any]):
        """The layer's arguments after the hidden state, flattened: (leaves, their tree spec). None of them may need a
        gradient: only the hidden state is carried through the loop."""
        from torch.utils._pytree import tree_flatten

        others, tree = tree_flatten((args[1:], kwargs))
        grads = [t for t in others if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            raise RuntimeError(f"scan_layers: an argument of the layers of {self.owner._scan_where} other than the "
                               f"hidden state requires grad (shape {tuple(grads[0].shape)}); only the hidden state is "
                               "carried through the loop. Turn scan_layers off for this model.")
        return others, tree

    def shaped(self, final: torch.Tensor, traced: Any) -> Any:
        """The loop's last hidden state as the layer returns its output (`traced`: what the traced layer returned, a
        tensor or a tuple whose other items are None)."""
        if isinstance(traced, torch.Tensor):
            return final
        if isinstance(traced, tuple) and all(t is None for t in traced[1:]):
            return (final,) + tuple(traced[1:])
        raise RuntimeError(f"scan_layers: the layers of {self.owner._scan_where} return "
                           f"{type(traced).__name__} with more than the hidden state; a scanned "
                           "loop carries only the hidden state. Turn scan_layers off.")

    def follow(self, index: int, args: Tuple) -> Any:
        if self.output is None:
            raise RuntimeError(f"scan_layers: layer {index} of {self.owner._scan_where} was called "
                               "before layer 0; a scanned ModuleList must be run in order.")
        if not args or args[0] is not self._hidden(self.output):
            raise RuntimeError(f"scan_layers: layer {index} of {self.owner._scan_where} did not get the previous "
                               "layer's output unchanged; the model works on the hidden state between its layers, "
                               "which a scanned loop cannot do. Turn scan_layers off for this model.")
        return self.output

    def start(self, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"scan_layers: the layers of {self.owner._scan_where} must take the "
                            "hidden state as their first positional argument.")
        self._refuse_per_layer_hooks()
        if _carries_cache(args[1:], kwargs):
            # generation: each layer writes its cache; run them as written
            out = args[0]
            settings = self.owner._scan_settings
            stored = self.owner.stored() if settings.layer_params is None else {}
            dtype = settings.compute_dtype
            for i, layer in enumerate(self.layers):
                if settings.layer_params is not None:
                    tensors = settings.layer_params(self.owner, i)
                else:  # stored stacks: the layer holds no parameters, its slice of each stack (in the compute dtype)
                    tensors = {n: t[i].to(dtype) if dtype is not None and t.is_floating_point() else t[i]
                               for n, t in stored.items()} or None
                if tensors is not None:
                    # the real layer (its own index for the cache), the slices set for the call
                    result = torch.func.functional_call(layer, tensors, (out,) + tuple(args[1:]), kwargs)
                else:
                    result = layer(out, *args[1:], **kwargs)
                out = self._hidden(result)
            self.output = result
            return result
        self.output = self.owner._scan_settings.loop(self, args, kwargs)
        return self.output

    def _refuse_per_layer_hooks(self) -> None:
        try:
            from transformers.utils.output_capturing import _active_collector

            collecting = _active_collector.get()
        except ImportError:
            collecting = None
        if collecting:
            raise RuntimeError(f"scan_layers: the model was asked for per-layer outputs "
                               f"({', '.join(k for k in collecting if not k.startswith('_'))}); a "
                               "scanned loop has no per-layer calls. Call it without "
                               "output_hidden_states/output_attentions, or turn scan_layers off.")
        now = _hook_keys(self.layers)
        for key, hooks in now.items():
            before = self.owner._scan_hooks.get(key, (frozenset(),) * 3)
            added = [h for h, b in zip(hooks, before) if h - b]
            if added and not _transformers_capture_only(self.layers, key, hooks, before):
                raise RuntimeError(f"scan_layers: a hook was registered on a layer of {self.owner._scan_where} after "
                                   "it was wrapped; a scanned loop cannot call per-layer hooks. Register it on the "
                                   "model instead, or turn scan_layers off.")


def _carries_cache(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    if any(v is not None and type(v).__name__.endswith("Cache") for v in list(args) + list(kwargs.values())):
        return True
    return bool(kwargs.get("use_cache")) and any(v is not None for k, v in kwargs.items() if "past" in k)


def _transformers_capture_only(layers, key, hooks, before) -> bool:
    """Hooks transformers installs to capture per-layer outputs; inactive unless a collector is set, which
    `_refuse_per_layer_hooks` checks."""
    module = next(m for layer in layers for m in layer.modules() if id(m) == key)
    for table, now, was in zip((module._forward_pre_hooks, module._forward_hooks, module._backward_hooks), hooks,
                               before):
        for handle in now - was:
            fn = table[handle]
            if getattr(fn, "__module__", "") != "transformers.utils.output_capturing":
                return False
    return True


def no_cache_by_default(root: nn.Module) -> None:
    """A transformers model whose config asks for a KV cache by default (GPT-2's `use_cache`) would pass one to its
    layers in training too, and a call with a cache runs the layers one by one; as transformers does for gradient
    checkpointing, the default is turned off (generation can still pass `use_cache=True`)."""
    config = getattr(root, "config", None)
    if getattr(config, "use_cache", False):
        logger.info("scan_layers: setting %s.config.use_cache = False (a KV cache runs the layers unscanned)",
                    type(root).__name__)
        config.use_cache = False
