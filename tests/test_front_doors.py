"""The two front doors over one engine state (issue 49): each door's public methods against its
anchor's, what `isinstance` says of each kind of unit, and torch_xla's methods the v1 door adds.

- `xla_fsdp.fsdp.FSDPModule` has exactly PyTorch's `FSDPModule` methods, plus `device_mesh`;
  it is not an `XlaFullyShardedDataParallel` (torch_xla's `no_sync`, `summon_full_params`,
  `get_shard_metadata`, `.module` are not FSDP2's).
- `xla_fsdp.XlaFullyShardedDataParallel` has every public method of torch_xla 2.9's, plus the
  documented additions below (docs/migration.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import xla_fsdp
from xla_fsdp.unit_state import state_of, units

torch_xla = pytest.importorskip("torch_xla")
ROOT = Path(__file__).resolve().parents[1]

# public names of the v1 door that torch_xla's XlaFullyShardedDataParallel does not have
V1_ADDITIONS = {
    "device_mesh": "the mesh the single controller shards over",
    "enable_activation_checkpointing": "what checkpoint_module(unit) does to a unit",
    "unshard": "FSDP2's name: parameters whole until reshard()",
    "reshard": "FSDP2's name: back to the shards",
    "set_requires_gradient_sync": "FSDP2's switch for gradient accumulation",
    "sharding_layout": "the unit's ranks and groups",
    "summon_full_params": "PyTorch FSDP1's context",
}
FSDP2_ADDITIONS = {"device_mesh": "the mesh (PyTorch's parameters report it as DTensors)"}


def _public(cls) -> set:
    return {n for n in dir(cls) if not n.startswith("_") and n not in dir(nn.Module)}


def test_fsdp_module_has_exactly_pytorchs_methods():
    from torch.distributed.fsdp import FSDPModule as Theirs

    from xla_fsdp.fsdp import FSDPModule

    assert _public(FSDPModule) == _public(Theirs) | set(FSDP2_ADDITIONS)
    assert not issubclass(FSDPModule, xla_fsdp.XlaFullyShardedDataParallel)


def test_xla_fsdp_has_torch_xlas_methods_and_the_documented_additions():
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as Theirs

    ours = _public(xla_fsdp.XlaFullyShardedDataParallel)
    assert ours == _public(Theirs) | set(V1_ADDITIONS)
    migration = (ROOT / "docs" / "migration.md").read_text()
    undocumented = sorted(n for n in set(V1_ADDITIONS) | _public(Theirs) if f"`{n}" not in migration)
    assert not undocumented, f"docs/migration.md does not name {undocumented}"


def test_torch_xlas_methods_at_xla_world_1():
    torch.manual_seed(0)
    model = xla_fsdp.FSDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
                          auto_wrap_policy=xla_fsdp.always_wrap_policy)
    dev = torch_xla.device()
    x = torch.randn(6, 4, device=dev)
    model.assert_state("IDLE")
    with pytest.raises(ValueError, match="expected to be in states"):
        model.assert_state(["FORWARD", "BACKWARD_PRE"])
    names = [n for n, _ in model.get_original_names_and_sharded_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert model.params_with_grad == []
    model(x).sum().backward()
    default = [p.grad.detach().cpu().clone() for p in model.parameters()]
    assert len(model.params_with_grad) == 4
    for p in model.parameters():
        p.grad = None
    model.set_gradient_divide_factors(2.0, 1.0, recursive=True)  # world 1: the sum over ranks / 2
    assert {state_of(u).group.grad_factor for u in units(model)} == {0.5}
    model(x).sum().backward()
    for before, p in zip(default, model.parameters()):
        torch.testing.assert_close(p.grad.detach().cpu(), before / 2)
    model.set_gradient_divide_factors(1.0, 1.0, recursive=True)
    assert {state_of(u).group.grad_factor for u in units(model)} == {1.0}


def test_each_door_makes_its_own_kind_of_unit(tmp_path):
    out = tmp_path / "doors.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fsdp2" / "api_cases.py"), "doors", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fully_shard"] == {"FSDPModule": True, "XlaFullyShardedDataParallel": False, "Net": True,
                                "units": 4, "state_holds_policies": True}
    assert r["v1"] == {"FSDPModule": False, "XlaFullyShardedDataParallel": True, "Net": True,
                       "units": 4, "state_holds_policies": False}
    assert "one of the two APIs" in r["mixed"]["message"]
