"""[Note: loading across stored stacks] (xla_fsdp/checkpoint/restack.py): how a checkpoint's
metadata is renamed between scan_layers' stored stacks and per-layer keys, and what it refuses.
The reads themselves are checked by training on after loading, on both engines
(tests/test_stored_stacks.py, tests/test_scan_layers.py)."""
from __future__ import annotations

import pytest
import torch.nn as nn

from xla_fsdp.checkpoint import restack
from xla_fsdp.checkpoint.format import CheckpointError

LAYERS = [f"layers.{i}.up.weight" for i in range(3)]


def _meta(params, state=None, groups=None, stacked=None):
    meta = {"params": {k: {"shape": v, "dtype": "float32", "aliases": []} for k, v in params.items()}}
    if stacked:
        meta["stacked"] = stacked
    if state is not None:
        meta["optimizer"] = {"class": "torch.optim.adamw.AdamW", "state": state,
                             "param_groups": groups or [{"hyper": {"lr": 0.1}, "params": list(params)}]}
    return meta


def _adam(shape, step=3.0):
    return {"step": {"kind": "scalar", "value": step, "tensor": True, "dtype": "float32"},
            "exp_avg": {"kind": "rows", "shape": shape, "dtype": "float32"}}


def test_a_stack_is_named_per_layer_for_a_model_without_scan():
    meta = _meta({"inp.weight": [16, 8], "layers_scan.up.weight": [10, 3, 16], "layers_scan.scale": [3]},
                 state={"layers_scan.up.weight": _adam([10, 3, 16])},
                 stacked={"layers_scan.up.weight": LAYERS, "layers_scan.scale": [f"layers.{i}.scale" for i in range(3)]})
    names = ["inp.weight", *LAYERS, *[f"layers.{i}.scale" for i in range(3)]]
    r = restack.plan(meta, names, nn.Linear(1, 1))
    assert r.split["layers.2.up.weight"] == ("layers_scan.up.weight", 2)
    params = r.meta["params"]
    assert set(params) == set(names)
    assert params["layers.1.up.weight"]["shape"] == [10, 16] and params["layers.0.scale"]["shape"] == []
    state = r.meta["optimizer"]["state"]
    assert set(state) == set(LAYERS)
    assert state["layers.0.up.weight"]["exp_avg"]["shape"] == [10, 16]
    assert state["layers.2.up.weight"]["step"]["value"] == 3.0
    group = r.meta["optimizer"]["param_groups"][0]["params"]
    assert r.same_group(list(reversed(names)), group) and not r.same_group(names[:-1], group)
    assert r.meta["stacked"] == {}


def test_the_same_names_need_no_renaming():
    meta = _meta({"inp.weight": [16, 8]})
    assert restack.plan(meta, ["inp.weight"], nn.Linear(1, 1)) is None


def test_layers_join_into_a_stack_and_refuse_what_one_stack_cannot_hold():
    meta = _meta({k: [10, 16] for k in LAYERS}, state={k: _adam([10, 16]) for k in LAYERS})
    r = restack.Restack(join={"layers_scan.up.weight": LAYERS})
    renamed = restack._renamed(meta, r)
    assert renamed["params"]["layers_scan.up.weight"]["shape"] == [10, 3, 16]
    assert renamed["optimizer"]["state"]["layers_scan.up.weight"]["exp_avg"]["shape"] == [10, 3, 16]
    assert renamed["optimizer"]["param_groups"][0]["params"] == ["layers_scan.up.weight"]
    # a step that differs between layers has no one value for the stack
    uneven = _meta({k: [10, 16] for k in LAYERS}, state={k: _adam([10, 16], step=float(i)) for i, k in enumerate(LAYERS)})
    with pytest.raises(CheckpointError, match="differs between the layers stacked as 'layers_scan.up.weight'"):
        restack._renamed(uneven, r)
    # state held for some layers only
    partial = _meta({k: [10, 16] for k in LAYERS}, state={LAYERS[0]: _adam([10, 16])})
    with pytest.raises(CheckpointError, match="1 of the 3 layers"):
        restack._renamed(partial, r)
    # state a rank computed over its own shard (Adafactor's column factor) has no per-layer value
    per_rank = _meta({k: [10, 16] for k in LAYERS},
                     state={k: {"exp_avg_sq_col": {"kind": "per_rank", "dtype": "float32"}} for k in LAYERS})
    with pytest.raises(CheckpointError, match="load into a model wrapped as when saving"):
        restack._renamed(per_rank, r)
