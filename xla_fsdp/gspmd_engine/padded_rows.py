"""Embedding tables and output projections whose rows do not split evenly over the chips, stored with zero rows
appended (the SPMD engine).

[Note: padded rows]
GPT-2's vocabulary has 50,257 entries: sharded on dim 0 over 4 chips, each holds 12,565 rows, not a multiple of the
TPU's 8-row tiles, and libtpu's code generation for everything that touches the table (lookup, LM head, their gradients,
the optimizer) slows down by the shapes (measured: the scanned 2B GPT-2 for v4-8 compiled in 81 s, with 12,568 rows per
chip in 28 s; docs/scan.md).

So a parameter whose row count is not a multiple of 8 x the shard count is stored with zero rows appended up to that
multiple (at most 1/8 more rows), when every module that holds it is an `nn.Embedding` or an `nn.Linear` without bias
(GPT-2's tied `wte`/`lm_head`, Llama's `embed_tokens` and `lm_head`): the lookup never reads the appended rows (token
ids are below the real count), and the projection's output is cut back to the real columns before anyone sees it, so the
model computes exactly what it did. Their gradient is zero, so the rows stay zero under SGD, Adam, AdamW and the other
element-wise optimizers, and the global norm is unchanged. `state_dict()` gives the real rows and `load_state_dict()`
takes them (saved models load anywhere). The module's `weight` itself has the appended rows: code that reads it outside
the module's forward sees them. A parameter held by any other module is left as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Dict, List, Tuple

import torch
import torch.nn as nn
import torch_xla.distributed.spmd as xs

from xla_fsdp.runtime.mesh import fsdp_degree, param_spec
from xla_fsdp.runtime.real_rows import set_real_rows

logger = logging.getLogger(__name__)

ROW_TILE = 8  # rows of a TPU memory tile (f32 and bf16)
MAX_EXTRA = 8  # pad by at most 1/8 of the rows (a small table over many chips stays as it is)


@dataclass
class PaddedRows:
    """One parameter stored padded: `rows` real rows of `param`."""

    param: nn.Parameter
    rows: int
    holders: List[Tuple[nn.Module, str]]


def _holders(root: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    out: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((module, name))
    return out


def _paddable(module: nn.Module, name: str) -> bool:
    if name != "weight":
        return False
    if type(module) is nn.Embedding:
        return module.max_norm is None  # max_norm renormalizes rows in place
    return type(module) is nn.Linear and module.bias is None


def pad_uneven_rows(root: nn.Module, mesh: xs.Mesh, scanned: Collection[nn.Module] = ()) -> List[PaddedRows]:
    """Stores every paddable parameter of `root` whose rows do not split into whole tiles per shard with zero rows
    appended ([Note: padded rows]); returns what it padded. Layers that will run in a scanned loop are left as they are
    (the loop runs a hook-free copy)."""
    multiple = ROW_TILE * fsdp_degree(mesh)
    holders = _holders(root)
    inside = {id(m) for layer in scanned for m in layer.modules()}
    seen, padded = set(), []
    for p in list(root.parameters()):
        if (id(p) in seen or p.dim() < 1 or not p.is_floating_point() or p.shape[0] % multiple == 0
                or (-p.shape[0] % multiple) * MAX_EXTRA > p.shape[0]):
            continue
        seen.add(id(p))
        held = holders.get(id(p), [])
        if not held or not all(_paddable(m, n) and id(m) not in inside for m, n in held):
            continue
        rows = p.shape[0]
        extra = -rows % multiple
        with torch.no_grad():
            data = torch.cat([p.detach(), p.new_zeros((extra,) + tuple(p.shape[1:]))])
        xs.mark_sharding(data, mesh, param_spec(data))
        stored = nn.Parameter(data, requires_grad=p.requires_grad)
        set_real_rows(stored, rows)
        for module, name in held:
            module._parameters[name] = stored
            if isinstance(module, nn.Linear):
                module.register_forward_hook(_real_columns(rows))
        padded.append(PaddedRows(stored, rows, held))
    if padded:
        ids = {id(r.param): r.rows for r in padded}
        root.__dict__["_xla_fsdp_padded_rows"] = {name: ids[id(p)] for name, p in
                                                  root.named_parameters(remove_duplicate=False) if id(p) in ids}
        root._register_state_dict_hook(_real_rows)
        root._register_load_state_dict_pre_hook(_pad_on_load, with_module=True)
        logger.info("padded rows: %s",
                    ", ".join(f"{type(r.holders[0][0]).__name__} {r.rows} -> {r.param.shape[0]}" for r in padded))
    return padded


def _real_columns(rows: int):
    def hook(module, args, out):
        return out[..., :rows]

    return hook


def _real_rows(root: nn.Module, state: Dict[str, torch.Tensor], prefix: str, _meta) -> None:
    for name, rows in root.__dict__["_xla_fsdp_padded_rows"].items():
        value = state.get(prefix + name)
        if value is not None and value.shape[0] != rows:
            state[prefix + name] = value[:rows]


def _pad_on_load(root: nn.Module, state, prefix, _meta, _strict, _missing, _unexpected, errors) -> None:
    params = dict(root.named_parameters(remove_duplicate=False))
    for name, rows in root.__dict__["_xla_fsdp_padded_rows"].items():
        value = state.get(prefix + name)
        if value is None or value.shape[0] != rows:
            continue
        extra = params[name].shape[0] - rows
        state[prefix + name] = torch.cat([value, value.new_zeros((extra,) + tuple(value.shape[1:]))])
