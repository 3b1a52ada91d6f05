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


def _adafactor(meta):
    meta["optimizer"]["class"] = "transformers.optimization.Adafactor"
    return meta


def test_adafactors_per_layer_state_of_a_stack_moves_on_dim_0():
    """[Note: Adafactor on stored stacks]: a stack's column factor (L, 16) and RMS (L,) are per
    layer on dim 0; a layer takes row i, and the layers' (their RMS saved as numbers) stack."""
    stack = {"exp_avg_sq_row": {"kind": "rows", "shape": [10, 3], "dtype": "float32"},
             "exp_avg_sq_col": {"kind": "whole", "shape": [3, 16], "dtype": "float32"},
             "RMS": {"kind": "whole", "shape": [3], "dtype": "float32"},
             "step": {"kind": "scalar", "value": 4, "tensor": False}}
    r = restack.Restack(split={k: ("layers_scan.up.weight", i) for i, k in enumerate(LAYERS)})
    meta = _adafactor(_meta({"layers_scan.up.weight": [10, 3, 16]}, state={"layers_scan.up.weight": stack}))
    layer = restack._renamed(meta, r)["optimizer"]["state"]["layers.2.up.weight"]
    assert layer["exp_avg_sq_row"]["shape"] == [10] and layer["exp_avg_sq_col"]["shape"] == [16]
    assert layer["RMS"] == {"kind": "whole", "shape": [], "dtype": "float32"} and layer["step"]["value"] == 4
    assert r.layers_first["optim/layers.2.up.weight/exp_avg_sq_col"] == ("optim/layers_scan.up.weight/exp_avg_sq_col", 2)
    # the same entries of another optimizer class have no per-layer meaning
    with pytest.raises(CheckpointError, match="load into a model wrapped as when saving"):
        restack._renamed(_meta({"layers_scan.up.weight": [10, 3, 16]}, state={"layers_scan.up.weight": stack}),
                         restack.Restack(split=dict(r.split)))

    per_layer = {k: {"exp_avg_sq_row": {"kind": "rows", "shape": [10], "dtype": "float32"},
                     "exp_avg_sq_col": {"kind": "whole", "shape": [16], "dtype": "float32"},
                     "RMS": {"kind": "scalar", "value": 0.5 + i, "tensor": True, "dtype": "float32"},
                     "step": {"kind": "scalar", "value": 4, "tensor": False}} for i, k in enumerate(LAYERS)}
    r = restack.Restack(join={"layers_scan.up.weight": LAYERS})
    joined = restack._renamed(_adafactor(_meta({k: [10, 16] for k in LAYERS}, state=per_layer)), r)
    state = joined["optimizer"]["state"]["layers_scan.up.weight"]
    assert state["exp_avg_sq_row"]["shape"] == [10, 3] and state["exp_avg_sq_col"]["shape"] == [3, 16]
    assert state["RMS"]["shape"] == [3] and r.values["optim/layers_scan.up.weight/RMS"].tolist() == [0.5, 1.5, 2.5]
    assert r.joined["optim/layers_scan.up.weight/exp_avg_sq_col"][1] == ("optim/layers.1.up.weight/exp_avg_sq_col", 16)
