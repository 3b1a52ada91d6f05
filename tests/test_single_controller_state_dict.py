"""`model.state_dict()` in the single-controller runtime has the unwrapped model's keys and shapes.

Each parameter there is one global tensor padded on dim 0 to a multiple of the
device count; the state dict cuts the padding off (as the GSPMD engine's has
none) and `load_state_dict` puts it back ([Note: state dicts of the single
controller]). The model has dim 0 sizes 4 devices do not divide (10, 3, 5 and
a 0-dim scale). tests/single_controller/full_shapes.py runs in a fresh process
with 4 XLA:CPU devices. `optimizer.state_dict()` follows (tests/single_controller/optimizer_state.py):
AdamW's state in the unwrapped shapes, loading both ways and going on with the same losses.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "single_controller" / "full_shapes.py"
DEVICES = 4


def _run_worker(worker: Path, out: Path):
    """Run a single-controller worker script at DEVICES devices; what it saved to `out`."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES))
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, str(worker), str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-6000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    return _run_worker(WORKER, tmp_path_factory.mktemp("full_shapes") / "out.pt")


def test_the_parameters_stay_padded_global_tensors(got):
    """The premise: what the optimizer holds is padded and sharded, and stays so after loading."""
    assert got["param_shapes"]["0.weight"] == [12, 16] and got["param_shapes"]["2.scale"] == [DEVICES]
    # 2001 rows: 501 a device, stored as 512 (whole 16-row tiles, [Note: shards in whole tiles]); a
    # bias (1-D) only to the device count; 288 rows (72 a device) stay: 80 would add more than 1/32
    assert got["param_shapes"]["5.weight"] == [DEVICES * 512, 5] and got["param_shapes"]["5.bias"] == [2004]
    assert got["param_shapes"]["6.weight"] == [288, 2001]
    assert got["fresh_param_shapes"] == got["param_shapes"]
    assert got["fresh_shardings"] == got["shardings"] and all(got["shardings"]), got["fresh_shardings"]


def _cut(padded: torch.Tensor, shape) -> torch.Tensor:
    """A padded global tensor -> its real rows in the unwrapped shape."""
    rows = shape[0] if shape else 1
    return padded.reshape(-1, *shape[1:])[:rows].reshape(shape)


def test_state_dict_has_the_unwrapped_keys_shapes_and_values(got):
    state = got["state"]
    assert list(state) == got["plain_keys"]
    assert {k: list(v.shape) for k, v in state.items()} == got["plain_shapes"] == got["gspmd_shapes"]
    for key, shape in got["plain_shapes"].items():  # the full parameters (after a training step)
        assert torch.equal(state[key], _cut(got["padded"][key], shape)), key
    for key, want in got["gathered"].items():  # and what the gathering full_state_dict gives
        assert torch.equal(state[key], want), key


def test_state_dict_loads_strictly_into_the_unwrapped_model(got):
    assert got["plain_load"] == "<All keys matched successfully>"
    torch.testing.assert_close(got["plain_logits"], got["logits"], rtol=1e-5, atol=1e-5)


def test_full_and_padded_state_dicts_load_back_into_a_wrapped_model(got):
    assert got["fresh_load"] == "<All keys matched successfully>"
    for key, shape in got["plain_shapes"].items():
        for loaded in ("fresh_padded", "old_padded"):
            assert torch.equal(got[loaded][key], got["padded"][key]), (loaded, key)  # padding rows zero
            assert torch.equal(_cut(got[loaded][key], shape), got["state"][key]), (loaded, key)
    torch.testing.assert_close(got["fresh_logits"], got["logits"], rtol=1e-5, atol=1e-5)


def test_get_state_dict_model_side_and_per_rank_consolidation(got):
    for other in ("dcp_model", "consolidated"):
        assert list(got[other]) == got["plain_keys"], other
        for key, want in got["state"].items():
            assert torch.equal(got[other][key], want), (other, key)


# -- optimizer.state_dict() ([Note: optimizer state of the single controller]) --------------

OPT_WORKER = ROOT / "tests" / "single_controller" / "optimizer_state.py"


@pytest.fixture(scope="module")
def opt_got(tmp_path_factory):
    return _run_worker(OPT_WORKER, tmp_path_factory.mktemp("optimizer_state") / "out.pt")


def test_optimizer_state_dict_has_the_unwrapped_shapes(opt_got):
    """AdamW's moments in the parameters' own shapes (10, 16), (), (3, 10), ... not padded on dim 0;
    what the optimizer holds stays padded (the premise)."""
    assert opt_got["opt_shapes"] == opt_got["plain_shapes"]
    assert opt_got["opt_shapes"][0]["exp_avg"] == [10, 16] and opt_got["opt_shapes"][2]["exp_avg"] == []
    assert list(opt_got["padded_opt"][0]["exp_avg"].shape) == [12, 16]


def test_optimizer_state_loads_into_the_unwrapped_model_and_continues_the_losses(opt_got):
    torch.testing.assert_close(torch.tensor(opt_got["plain_losses"]), torch.tensor(opt_got["losses"]),
                               rtol=1e-5, atol=1e-6)


def test_unwrapped_optimizer_state_resumes_a_wrapped_model_sharded_like_its_parameters(opt_got):
    """Loaded before the first step (a resume): held on the host until that step pads and shards it."""
    assert all(all(on_host.values()) for on_host in opt_got["fresh_on_host"].values()), opt_got["fresh_on_host"]
    assert opt_got["fresh_shapes"] == opt_got["plain_shapes"]
    for i, specs in opt_got["fresh_specs"].items():
        for key, spec in specs.items():
            assert spec == opt_got["param_specs"][i], (i, key, spec)  # placed as the parameter, not replicated
    torch.testing.assert_close(torch.tensor(opt_got["fresh_losses"]), torch.tensor(opt_got["losses"]),
                               rtol=1e-5, atol=1e-6)


def test_padded_optimizer_state_still_loads(opt_got):
    """What state_dict() gave before (the padded global tensors) resumes as it did."""
    torch.testing.assert_close(torch.tensor(opt_got["old_losses"]), torch.tensor(opt_got["losses"]),
                               rtol=1e-5, atol=1e-6)
