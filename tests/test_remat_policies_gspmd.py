"""Recomputation policies ([Note: recomputation policies]) on the GSPMD engine, at 4 XLA:CPU devices
in an SPMD process (tests/spmd_cases/remat_case.py): each policy trains like the full recomputation,
within 1e-5 (first step's gradients, losses and parameters after 3 AdamW steps), unscanned (the
engine's checkpointed units) and scanned (torch_xla's scan with the policy's partitioner), and its
program has fewer dots than "full" where it saves matmuls. `-m slow` runs every policy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xla_fsdp.memory.remat_policy import NAMES

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "tests" / "spmd_cases" / "remat_case.py"


def _run(*cases: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_USE_SPMD="1")
    got = subprocess.run([sys.executable, str(CASE), "gspmd", *cases], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    lines = [line for line in got.stdout.splitlines() if line.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check(results: dict) -> None:
    for case, r in results.items():
        assert r["losses"] <= 1e-5 and r["grads"] <= 1e-5 and r["params"] <= 1e-5, (case, r)
        policy = case.split(":")[1]
        if policy in ("full", "full_offloaded"):
            assert r["dots"] == r["full_dots"], (case, r)
        else:  # saved matmuls leave the recomputation ("none": nothing is recomputed)
            assert r["dots"] < r["full_dots"], (case, r)


def test_policies_train_like_full_recompute_scanned_and_not():
    _check(_run("unscanned:save_qkv_proj", "scan:minimal_offloaded"))  # GPT-2's c_attn: -m slow, and the
    # collectives engine's test_gpt2_roles_save_its_fused_projection


@pytest.mark.slow
def test_every_policy_on_the_gspmd_engine():
    # "fit" picks each unit's policy on the collectives engine only; this engine refuses it (test below)
    cases = [f"{where}:{name}" for where in ("unscanned", "scan") for name in NAMES if name not in ("full", "fit")]
    _check(_run(*cases, "unscanned:minimal:gpt2", "scan:qkv_proj_offloaded:gpt2", "scan:save_dot_except_mlp:gpt2"))


def test_fit_is_refused_naming_a_policy_to_give():
    import xla_fsdp
    import torch.nn as nn

    with pytest.raises(ValueError, match=r'remat_policy="fit" chooses each unit\'s policy .* collectives engine only; '
                                         r"name a policy for engine='spmd'"):
        xla_fsdp.FSDP(nn.Sequential(nn.Linear(4, 4)), engine="spmd", activation_checkpointing=True,
                      remat_policy="fit")
