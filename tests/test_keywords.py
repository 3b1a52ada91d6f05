"""torch_xla's constructor surface: every keyword is accepted or refused by name, and the
FSDPv1 / FSDP2 methods migrating scripts call (XLA world 1 and gloo world 2)."""
import inspect
import os

import pytest
import torch
import torch.nn as nn

import xla_fsdp
from xla_fsdp import FSDP
from xla_fsdp.keywords.resolve import DEFAULTS, NO_EFFECT, REFUSED
from parity_cases import run_distributed_fn

torch_xla = pytest.importorskip("torch_xla")

# a value other than torch_xla's default for each keyword, and what happens with it here
NON_DEFAULT = {
    "reshard_after_forward": False, "flatten_parameters": True, "execute_sharding_on_init": False,
    "optimization_barrier_in_forward": False, "optimization_barrier_in_backward": False,
    "sync_on_finalization": True, "disable_reshard_on_root": False, "compute_dtype": torch.bfloat16,
    "buffer_dtype": torch.bfloat16, "fp32_reduce_scatter": True, "sharding_groups": [[0]], "sharding_rank": 0,
    "sharding_world_size": 1, "shard_param_on_dim_0": True, "pin_layout_in_collective_ops": False,
    "reduce_scatter_bucket_size_mb": 1, "coalesce_all_gather_ops": True,
    "auto_wrap_policy": xla_fsdp.always_wrap_policy, "auto_wrapper_callable": None, "param_init_fn": None,
    "_shard_size_multiple": 8, "_use_xla_patched_linear": False, "_debug_dummy_forward_pass": True,
    "_debug_msg": "mine", "_debug_print": True, "_debug_dummy_all_gather_op": True,
    "_debug_dummy_all_reduce_op": True, "_debug_dummy_reduce_scatter_op": True,
    "_debug_dummy_optimization_barrier_op": True,
}
REFUSED_HERE = {k: "debugging switch" for k in REFUSED}


def torch_xla_keywords():
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as TorchXlaFSDP

    return {name: p.default for name, p in inspect.signature(TorchXlaFSDP.__init__).parameters.items()
            if name not in ("self", "module")}


def test_every_torch_xla_keyword_is_classified():
    theirs = torch_xla_keywords()
    unclassified = sorted(set(theirs) - set(NON_DEFAULT))
    assert not unclassified, f"torch_xla added keywords xla_fsdp has not classified: {unclassified}"
    assert set(theirs) <= set(DEFAULTS)
    assert set(NO_EFFECT) | set(REFUSED) <= set(theirs)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_keyword_is_accepted_or_refused_by_name(name):
    theirs = torch_xla_keywords()
    if theirs[name] is not inspect.Parameter.empty and name != "flatten_parameters":
        FSDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), **{name: theirs[name]})  # their default: accepted
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    if name in REFUSED_HERE:
        with pytest.raises(ValueError, match=rf"{name}.*{REFUSED_HERE[name]}"):
            FSDP(model, **{name: NON_DEFAULT[name]})
        assert type(model) is nn.Sequential
    else:
        wrapped = FSDP(model, **{name: NON_DEFAULT[name]})
        out = wrapped(torch.ones(2, 3).to(wrapped[0].weight.device))
        assert out.shape == (2, 2)


@pytest.mark.parametrize("value", ["yes", 1, None, "False"])
def test_shard_param_on_dim_0_must_be_a_bool(value):
    """torch_xla tests the value's truth, so "False" there means True; here anything but a bool is refused."""
    model = nn.Linear(3, 4)
    with pytest.raises(TypeError, match=rf"shard_param_on_dim_0={value!r} is not a bool; pass True or False"):
        FSDP(model, shard_param_on_dim_0=value)
    assert type(model) is nn.Linear and model.weight.shape == (4, 3)


def test_mixed_precision_policy_objects():
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    ours = FSDP(nn.Linear(3, 4), mixed_precision=xla_fsdp.MixedPrecision(compute_dtype=torch.bfloat16,
                                                                          fp32_reduce_scatter=True))
    mp = ours._fsdp_state.options.mixed_precision
    assert mp.compute_dtype is torch.bfloat16 and mp.reduce_dtype is torch.float32
    torch_style = FSDP(nn.Linear(3, 4), mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16,
                                                                            reduce_dtype=torch.float32))
    assert torch_style._fsdp_state.options.mixed_precision == mp
    with pytest.raises(ValueError, match="mixed_precision= and compute_dtype both set the dtypes"):
        FSDP(nn.Linear(3, 4), mixed_precision=mp, compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="coalesce_all_gather_ops=True asks for one collective per unit"):
        FSDP(nn.Linear(3, 4), coalesce_all_gather_ops=True, flatten_parameters=False)


def _full_parameter_methods(device, sync):
    """unshard / reshard / summon_full_params on a nested model: returns what the test checks."""
    from xla_fsdp.checkpoint import full_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    plain.load_state_dict(model.state_dict())
    model = FSDP(model, auto_wrap_policy=xla_fsdp.always_wrap_policy)
    x = torch.randn(4, 8)
    out = {"module_is_self": model.module is model}
    with torch.no_grad(), model.summon_full_params():
        out["full_shapes"] = [tuple(p.shape) for p in model.parameters()]
        out["eval"] = model(x.to(device)).cpu()
        model[0].weight.mul_(2.0)  # written back on exit
    out["plain"] = plain(x).detach()
    out["shard_shapes"] = [tuple(p.shape) for p in model.parameters()]
    out["doubled"] = full_state_dict(model, rank0_only=False)["0.weight"]
    out["expected"] = plain[0].weight.detach() * 2
    model[2].unshard()
    out["unsharded_shape"] = tuple(model[2].weight.shape)
    with pytest.raises(RuntimeError, match="is unsharded.*reshard"):
        model[2](torch.ones(1, 16).to(device))
    model[2].reshard()
    out["resharded_shape"] = tuple(model[2].weight.shape)
    return out


def _check_full_parameter_methods(out, world):
    assert out["module_is_self"]
    assert out["full_shapes"] == [(16, 8), (16,), (3, 16), (3,)]
    torch.testing.assert_close(out["eval"], out["plain"], rtol=1e-5, atol=1e-5)
    assert out["shard_shapes"] == [(16 // world, 8), (16 // world,), (-(-3 // world), 16), (-(-3 // world),)]
    torch.testing.assert_close(out["doubled"], out["expected"])
    assert out["unsharded_shape"] == (3, 16) and out["resharded_shape"] == (-(-3 // world), 16)


def test_full_parameter_methods_at_xla_world_1():
    _check_full_parameter_methods(_full_parameter_methods(torch_xla.device(), torch_xla.sync), 1)


def _worker(rank, world, tmp):
    out = _full_parameter_methods(torch.device("cpu"), None)
    torch.save(out, os.path.join(tmp, f"full{rank}.pt"))


def test_full_parameter_methods_at_gloo_world_2(tmp_path):
    run_distributed_fn(_worker, 2, str(tmp_path))
    for rank in range(2):
        _check_full_parameter_methods(torch.load(tmp_path / f"full{rank}.pt", weights_only=False), 2)


def test_the_migration_guide_names_every_keyword_as_the_table_classifies_it():
    """docs/migration.md's two keyword tables against the one table (xla_fsdp/keywords/table.py):
    every keyword named, each refused one in the row that says so, each no-effect one in a row
    that says "no effect"."""
    from pathlib import Path

    from xla_fsdp.keywords import table

    text = (Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `")]

    def rows_naming(name):
        return [r for r in rows if f"`{name}`" in r or (name.startswith("_debug_dummy_") and "`_debug_dummy_*`" in r)]

    unnamed = [k.name for k in table.KEYWORDS if k.name != "collectives" and not rows_naming(k.name)]
    assert not unnamed, f"docs/migration.md's keyword tables do not name {unnamed}"
    for k in table.KEYWORDS:
        if k.effect == table.REFUSED:
            assert any("refused when set" in r for r in rows_naming(k.name)), k.name
        elif k.effect:
            assert any("no effect" in r for r in rows_naming(k.name)), k.name
