"""scan_layers on the collectives engine's single controller stores the scanned layers' shards
stacked ([Note: the collectives engine's stored stacks]): one parameter per name whatever the
depth, state dicts, optimizer state, shard metadata and checkpoints per layer as unscanned.

tests/single_controller/stored_stacks.py runs in a fresh process with 4 XLA:CPU devices: a stack
of three blocks with 10-row weights (3 rows a device, padded to 12) and a buffer per layer, AdamW
with clipping, scanned with stored stacks, with "per_step" and unscanned from the same weights.
"""
from __future__ import annotations

import pytest
import torch

from test_single_controller_state_dict import ROOT, _run_worker

WORKER = ROOT / "tests" / "single_controller" / "stored_stacks.py"
LAYERS = 3


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    return _run_worker(WORKER, tmp_path_factory.mktemp("stored_stacks") / "out.pt")


def _same_state(a: dict, b: dict, tol: float = 1e-6) -> None:
    assert list(a) == list(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def test_the_layers_are_one_parameter_per_name_padded_and_sharded(got):
    params = got["True"]["params"]
    assert not any(n.startswith("layers.") for n in params), params
    # (padded rows, layers, *rest): 10 rows over 4 devices are 3 a device, 12 stored
    assert params["layers_scan.up.weight"] == [12, LAYERS, 16]
    assert params["layers_scan.up.bias"] == [12, LAYERS]
    assert params["layers_scan.down.weight"] == [16, LAYERS, 10]
    # "per_step" keeps each layer's own parameters
    assert "layers.2.up.weight" in got["per_step"]["params"] and "layers_scan.up.weight" not in got["per_step"]["params"]


def test_training_matches_the_unscanned_model(got):
    """Losses, clipping's global norms and every trained value after 3 AdamW steps."""
    ref = got["False"]
    for mode in ("True", "per_step"):
        torch.testing.assert_close(torch.tensor(got[mode]["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got[mode]["norms"]), torch.tensor(ref["norms"]), rtol=1e-6, atol=1e-6)
        _same_state(got[mode]["state"], ref["state"], 1e-5)


def test_state_dicts_load_either_way(got):
    """The unscanned model's state dict into a scanned model and the reverse: the same values,
    and the same losses on two more steps."""
    _same_state(got["loaded_into_stored"], got["False"]["state"])
    _same_state(got["loaded_into_plain"], got["True"]["state"])
    torch.testing.assert_close(torch.tensor(got["after_load"]["stored"]), torch.tensor(got["after_load"]["plain"]),
                               rtol=1e-6, atol=1e-6)


def test_optimizer_state_resumes(got):
    """AdamW's state dict holds the stacks' real rows (10 of 12) and resumes the run exactly."""
    assert (10, LAYERS, 16) in got["optim_shapes"] and (12, LAYERS, 16) not in got["optim_shapes"]
    assert got["resume"]["resumed"] == got["resume"]["original"]


def test_shard_metadata_names_each_layer(got):
    meta = got["metadata"]
    assert set(meta) == set(got["True"]["state"]) - {f"layers.{i}.gain" for i in range(LAYERS)}
    assert meta["layers.1.up.weight"] == ([10, 16], 10) and meta["layers.2.down.bias"] == ([16], 16)


def test_checkpoints_round_trip_and_consolidate_per_layer(got):
    ck = got["checkpoint"]
    _same_state(ck["loaded"], ck["saved"], 0.0)
    assert ck["after"][0] == ck["after"][1]
    # [Note: loading across stored stacks]: the stacked checkpoint resumes in the model without
    # scan, and an unscanned run's in the scanned model, AdamW's moments and steps included
    torch.testing.assert_close(torch.tensor(ck["into_plain"]), torch.tensor(ck["after"][0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(ck["into_stored"][1]), torch.tensor(ck["into_stored"][0]),
                               rtol=1e-6, atol=1e-6)
    full = got["consolidated"]
    for k, v in ck["saved"].items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=k)


def test_adafactor_steps_each_layer_of_the_stacks_and_its_state_loads_either_way(got):
    """[Note: Adafactor on stored stacks]: HF Trainer's Adafactor (weight decay, the padded rows
    of 10-row weights) on the stored stacks trains as on the unscanned model; its state resumes
    through optimizer.state_dict() and xla_fsdp.checkpoint, into the scanned model and the
    unscanned one, and an unscanned run's into the scanned model."""
    r = got["adafactor"]
    assert r["losses_True"] == pytest.approx(r["losses_False"], rel=1e-6)
    assert r["losses_True"][-1] < r["losses_True"][0]
    _same_state(r["state_True"], r["state_False"], tol=1e-6)
    # the row factor keeps the weight's 10 real rows and the layers on dim 1; the column factor
    # and the RMS hold one entry per layer on dim 0
    assert r["optim_shapes"] == {"exp_avg_sq_row": (10, LAYERS), "exp_avg_sq_col": (LAYERS, 16), "RMS": (LAYERS,)}
    original, resumed = r["resume"]
    assert resumed == original
    saved, loaded, into_plain = r["checkpoint"]
    assert loaded == saved and into_plain == pytest.approx(saved, rel=1e-6)
    plain, into_stored = r["into_stored"]
    assert into_stored == pytest.approx(plain, rel=1e-6)


def test_generation_with_a_kv_cache_gathers_layer_by_layer(got):
    """A call with a cache runs the layers one by one ([Note: scanning the layers of a ModuleList]):
    the same logits and greedy tokens as unscanned, sharded and under summon_full_params."""
    g = got["generate"]
    torch.testing.assert_close(g["logits_True"], g["logits_False"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g["summoned_True"], g["logits_False"], rtol=1e-5, atol=1e-5)
    assert torch.equal(g["tokens_True"], g["tokens_False"])


def test_what_stacks_cannot_hold_is_refused_at_wrap_time(got):
    """A 0-dim parameter and a weight tied inside the layer: refused naming the way out, which
    wraps them ("per_step" keeps per-layer parameters)."""
    r = got["refusals"]
    assert "layers.0.scale is a 0-dim parameter" in r[("scalar", True)] and '"per_step"' in r[("scalar", True)]
    assert "layers.0.back.weight is the same tensor as layers.0.down.weight" in r[("tied", True)]
    assert '"per_step"' in r[("tied", True)]
    assert r[("scalar", "per_step")] is None and r[("tied", "per_step")] is None
