"""scan_layers (the SPMD engine's XLA While loop over GPT-2's blocks) against the
same engine unscanned, on virtual CPU devices: losses and every parameter after
SGD-with-momentum steps, state-dict keys, a checkpoint loading into the plain model, the
loop in the step's HLO, and the misuse that must fail loudly.

Each scenario runs tests/spmd_cases/scan_case.py in its own SPMD process.
Tolerance: 1e-5 on losses (relative) and parameters (absolute): the loop body
is the same per-layer program the unscanned trace repeats.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "tests" / "spmd_cases" / "scan_case.py"


def run_case(devices: int, *argv: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), XLA_USE_SPMD="1")
    got = subprocess.run(
        [sys.executable, str(CASE), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    lines = [l for l in got.stdout.splitlines() if l.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def check_parity(r: dict, layers: int) -> None:
    assert r["layers_type"] == "ScannedLayers"
    assert r["same_keys"]
    # the scanned model's state dict, loaded into the plain CPU model, computes its loss (bf16: the
    # scanned model computes in bf16, the CPU model in float32)
    tol = 2e-2 if r["bf16"] else 1e-5
    assert abs(r["reload_loss"] - r["scan_loss_now"]) <= tol * abs(r["scan_loss_now"]), r
    for a, b in zip(r["plain_losses"], r["scan_losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (r["plain_losses"], r["scan_losses"])
    worst = max(r["param_max_abs_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, worst
    # the layers became one loop: the unscanned step repeats every block's matmuls
    assert r["while_plain"] == 0 and r["while_scan"] >= 2  # forward and backward loops
    assert r["dots_scan"] < r["dots_plain"]


@pytest.fixture(scope="module")
def at_4():
    """Parity and misuse at 4 devices, one process (the default run's cases)."""
    return run_case(4, "both", "--layers", "4")  # parity, misuse, stored stacks, dropout


def test_scan_matches_unscanned_at_4_devices(at_4):
    check_parity(at_4["parity"], 4)


@pytest.mark.slow
def test_scan_with_recompute_matches_at_8_devices():
    check_parity(run_case(8, "parity", "--layers", "4", "--ckpt"), 4)


@pytest.mark.slow
def test_per_step_stacking_matches_at_4_devices():
    """scan_layers="per_step": per-layer parameters stacked every step (for Adafactor)."""
    check_parity(run_case(4, "parity", "--layers", "3", "--per-step"), 3)


@pytest.mark.slow
def test_scanned_llama_matches_at_4_devices():
    """LlamaModel loops over `self.layers[:n]` with rotary embeddings as arguments."""
    check_parity(run_case(4, "parity", "--layers", "3", "--model", "llama"), 3)


@pytest.mark.slow
def test_scan_bf16_compute_matches_at_4_devices():
    r = run_case(4, "parity", "--layers", "3", "--dtype", "bf16")
    for a, b in zip(r["plain_losses"], r["scan_losses"]):
        assert abs(a - b) <= 1e-3 * abs(a)  # measured 1.3e-5
    assert max(r["param_max_abs_diff"].values()) <= 3e-3  # measured 7.1e-4 (bf16 rounding)


def test_scan_misuse_fails_loudly(at_4):
    r = at_4["errors"]
    assert "layer 1 of blocks" in r["not_identical"] and "must be identical" in r["not_identical"]
    assert "fsdp_transformer_layer_cls_to_wrap" in r["not_wrapped"]
    assert "scan_layers='stacked' is not valid" in r["collectives_engine"]
    assert r["use_cache_after_wrap"] is False
    assert "output_hidden_states" in r["hidden_states"]
    assert "after it was wrapped" in r["hook_after_wrap"]
    # a call with a KV cache runs the layers one by one: same logits as unscanned
    assert r["cache_logits_diff"] <= 1e-5


def test_stored_stacks_checkpoint_adafactor_and_refusals(at_4):
    """[Note: parameters stored stacked]: each layer parameter is one (d0, L, *rest) tensor sharded
    on dim 0; the sharded checkpoint resumes exactly (also in the model without scan, and an
    unscanned run's in the scanned model), consolidates and save_pretrained's per layer; Hugging
    Face's Adafactor steps each layer as without scan, torch's is refused, naming "per_step"."""
    r = at_4["stored"]
    assert r["stored_shape"] == [64, 3, 192] and r["layer_has_param"] is False
    assert r["decay_same"] is True  # transformers' weight-decay groups as without scan
    assert r["resumed"] == r["continued"]
    assert r["consolidated_diff"] == 0.0 and r["save_pretrained_diff"] == 0.0
    assert r["load_state_dict_diff"] == 0.0
    # [Note: loading across stored stacks]: scanned -> unscanned and the reverse resume exactly
    assert r["into_unscanned"] == pytest.approx(r["continued"], rel=1e-5)
    assert r["into_scanned"] == pytest.approx(r["unscanned_continued"], rel=1e-5)
    assert "another depth" in r["into_other_depth"] and "Nothing was loaded" in r["into_other_depth"]
    # [Note: Adafactor on stored stacks]: each layer steps as without scan
    scanned, plain = r["adafactor_losses"]
    assert len(scanned) == 3 and scanned == pytest.approx(plain, rel=1e-5)
    assert r["adafactor_keys_same"] and r["adafactor_param_diff"] <= 1e-5 < r["adafactor_moved"]
    # the key bias's zero gradient, normalized to +-1 step (1e-5) by Adafactor, follows rounding
    assert r["adafactor_key_bias_diff"] <= 3 * 2 * 1e-5
    assert "torch.optim.Adafactor is not" in r["torch_adafactor"] and '"per_step"' in r["torch_adafactor"]
    assert "shared weights" in r["shared"] and "per_step" in r["shared"]


def test_dropout_differs_per_layer_and_step_and_matches_in_backward(at_4):
    """[Note: dropout under scan]: torch_xla's scan applied one dropout mask to every layer
    (measured before the fix: a 4-layer NoiseStack gave only 0 or 8). Each layer's mask is
    decoded from the output and checked against the gradient of its weight, which the
    backward computes from the masks it used (recomputed there with activation checkpointing)."""
    r = at_4["random"]
    for case in ("masks", "masks_recompute"):
        m = r[case]
        assert m["grad_diff"] == 0.0, m  # backward used the forward's masks
        assert 0.4 < m["keep_fraction"] < 0.6, m
        assert m["layers_agree"] < 0.7, m  # 1.0 when every layer shares a mask
        assert m["steps_agree"] < 0.7, m  # a new mask each step
    assert "torch.rand_like" in r["rand_refused"] and "same numbers" in r["rand_refused"]


@pytest.mark.slow  # 15 s; dropout under scan stays in the default run above and in tests/test_scan_units.py
def test_gpt2_attention_dropout_and_its_own_dropouts_under_scan():
    r = run_case(4, "random_gpt2")
    # attention dropout (p 1e-9) through the written-out attention: as without dropout
    for a, b in zip(r["attention_plain"], r["attention_keyed"]):
        assert abs(a - b) <= 1e-5 * abs(a)
    # GPT-2's own dropouts (0.1) under scan: no reference draws the same masks, so the first step's loss
    # (from the same weights and batch) is held within 5% of the run without dropout, and must differ from it
    first, undropped = r["dropout_losses"][0], r["attention_plain"][0]
    assert abs(first - undropped) <= 0.05 * undropped and r["dropout_losses"] != r["attention_plain"], r


@pytest.mark.slow
def test_adafactor_checkpoints_load_across_stored_stacks_on_the_gspmd_engine():
    """[Note: Adafactor on stored stacks] and [Note: loading across stored stacks] on the GSPMD
    engine: a scanned run's checkpoint with Adafactor's state goes on in the unscanned model as the
    scanned run does, and the reverse (the single controller's case is in test_stored_stacks.py)."""
    r = run_case(4, "stored_adafactor")
    for scan in ("True", "False"):
        assert len(r[f"continued_{scan}"]) == 2
        assert r[f"across_{scan}"] == pytest.approx(r[f"continued_{scan}"], rel=1e-5), r
