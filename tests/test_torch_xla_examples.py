"""torch_xla's FSDP example flow run with the import lines swapped for xla_fsdp's (issue 41).

tests/fixtures/txla_fsdp_example.py is a conv + BatchNorm classifier written the way torch_xla's
FSDP examples are (argparse flags, `_mp_fn(index, flags)`, `xmp.spawn`, nested or auto wrapping,
`checkpoint_module`, per-rank files, `consolidate_sharded_model_checkpoints`). Each case runs it
twice at XLA world 1 through torch_xla's xmp.spawn, each in a fresh interpreter: once unchanged
(torch_xla's FSDP) and once with only its two `# IMPORT` lines replaced by xla_fsdp's.

[Note: how close the two libraries' runs must be]
The two libraries compile different programs for the same training (different graphs around the
same convolutions and matmuls), so bitwise equality is not promised: float32 losses and
consolidated weights are compared with rtol=1e-5, atol=1e-6 (atol for values near zero, where a
relative bound means nothing). Measured on XLA:CPU, torch_xla 2.9: the two were bit-identical
(every max difference of losses, consolidated weights, BatchNorm statistics and test outputs
0.0) over this file's cases at optimization level 0 (the suite's setting) and at XLA's default
level (XLA_FSDP_TEST_OPT=1), and over the full float32 product, 3 wrappings x 2^5 boolean flags,
run once at level 0 (one interpreter per library calling `_mp_fn(0, flags)` for each). So the
tolerance leaves room for other compilers (TPU, other XLA versions), not for drift seen here.
The BatchNorm step counters must be equal exactly.

torch_xla's FSDP cannot run this model with compute_dtype=bfloat16 ("Input type (c10::BFloat16)
and bias type (float) should be the same"), so bfloat16 is checked with ours alone: it trains to
the end and its consolidated checkpoint is a float32 state dict that loads into the plain model.
"""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torch_xla")

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "txla_fsdp_example.py")
IMPORT_SWAP = {
    "from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP, "
    "consolidate_sharded_model_checkpoints, checkpoint_module  # IMPORT":
    "from xla_fsdp import XlaFullyShardedDataParallel as FSDP, consolidate_sharded_model_checkpoints, "
    "checkpoint_module",
    "from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy  # IMPORT":
    "from xla_fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy",
}
TORCH_XLA_BF16_ERROR = "Input type (c10::BFloat16) and bias type (float) should be the same"
RTOL, ATOL = 1e-5, 1e-6  # [Note: how close the two libraries' runs must be]


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of the example script's flags."""
    wrap: str  # "nested" (by hand), "size_based" or "type_based" (auto-wrap policies), "none" (root only)
    checkpointing: bool = False
    flatten_parameters: bool = False
    shard_param_on_dim_0: bool = False
    pin_layout: bool = False
    fp32_reduce_scatter: bool = False
    compute_dtype: str = "float32"

    def flags(self):
        flags = ["--use_nested_fsdp"] if self.wrap == "nested" else ["--auto_wrap_policy", self.wrap]
        # with "none" the script wraps the root alone and --use_gradient_checkpointing has no unit to act on
        for on, flag in [(self.checkpointing, "--use_gradient_checkpointing"),
                         (self.flatten_parameters, "--flatten_parameters"),
                         (self.shard_param_on_dim_0, "--shard_param_on_dim_0"),
                         (self.pin_layout, "--pin_layout_in_collective_ops"),
                         (self.fp32_reduce_scatter, "--fp32_reduce_scatter")]:
            flags += [flag] if on else []
        return flags + ["--compute_dtype", self.compute_dtype]

    @property
    def id(self):
        on = [f.name for f in dataclasses.fields(self)[1:-1] if getattr(self, f.name)]
        return "-".join([self.wrap, self.compute_dtype] + on)


# The default suite's case: nested units, every boolean flag on.
DEFAULT = Case("nested", True, True, True, True, True)


def _all_pairs():
    """float32 cases in which every value of every flag meets every value of every other flag
    (all pairs; the full product is 4 x 2^5 runs of each library, more than this host affords).
    Each wrapping runs a row of flags and, with checkpointing, its complement; the rows' columns
    (flatten, dim 0, pin, fp32 reduce-scatter) are distinct non-zero codes over the five rows."""
    rows = [("nested", (0, 0, 0, 0)), ("size_based", (0, 1, 1, 1)), ("type_based", (1, 0, 1, 1)),
            ("nested", (1, 1, 0, 1)), ("none", (1, 0, 0, 1))]
    cases = []
    for wrap, bits in rows:
        cases.append(Case(wrap, False, *map(bool, bits)))
        cases.append(Case(wrap, True, *(not b for b in bits)))
    return cases


F32_MATRIX = [c for c in _all_pairs() if c != DEFAULT]
BF16_CASES = [Case("nested", True, fp32_reduce_scatter=True, compute_dtype="bfloat16"),
              Case("size_based", False, True, True, compute_dtype="bfloat16"),
              Case("type_based", True, False, False, True, True, compute_dtype="bfloat16")]


def _script(tmp_path, ours):
    text = open(SCRIPT).read()
    for theirs, mine in IMPORT_SWAP.items():
        assert text.count(theirs) == 1, theirs
        if ours:
            text = text.replace(theirs, mine)
    path = tmp_path / ("example_ours.py" if ours else "example_torch_xla.py")  # never a package's name
    path.write_text(text)
    return path


def _start(tmp_path, case, ours, num_cores=None):
    """The script in a fresh interpreter at XLA:CPU world 1, through its own xmp.spawn: with
    num_cores=None spawn starts one child for the one device, with 1 it runs in the process."""
    name = "ours" if ours else "torch_xla"
    out = tmp_path / f"out-{name}"
    out.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("CPU_NUM_DEVICES", None)
    argv = [sys.executable, str(_script(tmp_path, ours)), *case.flags(), "--ckpt_prefix", str(out / "final_ckpt"),
            "--result_path", str(out / "result.pt")]
    argv += ["--num_cores", str(num_cores)] if num_cores else []
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return proc, out


def _finish(proc, out):
    log, _ = proc.communicate(timeout=600)
    result = torch.load(out / "result.pt", weights_only=False) if proc.returncode == 0 else None
    return proc.returncode, log, result


def _example_module():
    """The fixture script as a module (torch_xla's imports; nothing runs at import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("txla_fsdp_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_run(case, rc, log, result, out):
    """What every run of ours must show: it trained to the end and consolidated the torch_xla way."""
    assert rc == 0, log[-4000:]
    assert f"saved consolidated model to {out / 'final_ckpt'}_consolidated.pth" in log
    assert result["fsdp_class"].startswith("xla_fsdp."), result["fsdp_class"]  # the swap took effect
    plain = _example_module().ConvBNClassifier()
    plain.load_state_dict(result["consolidated"])  # every key, the plain model's names
    buffers = {name for name, _ in plain.named_buffers()}
    for name, value in result["consolidated"].items():  # float32 parameters; buffers in buffer_dtype,
        if value.is_floating_point():  # which defaults to compute_dtype in torch_xla's FSDP and ours
            want = getattr(torch, case.compute_dtype) if name in buffers else torch.float32
            assert value.dtype == want, (name, value.dtype)
    assert torch.isfinite(torch.tensor(result["losses"])).all()
    assert result["losses"][-1] < result["losses"][0]
    assert result["consolidated_accuracy"] > 50  # learned: chance is 10
    if case.compute_dtype == "float32":  # at world 1 BatchNorm's statistics are the whole batch's: same model
        torch.testing.assert_close(result["consolidated_outputs"], result["outputs"], rtol=RTOL, atol=ATOL)


def _max_differences(ours, theirs):
    loss_ours, loss_theirs = torch.tensor(ours["losses"]), torch.tensor(theirs["losses"])
    diff = {"loss_abs": (loss_ours - loss_theirs).abs().max().item(),
            "loss_rel": ((loss_ours - loss_theirs).abs() / loss_theirs.abs()).max().item(),
            "weight_abs": 0.0, "weight_rel": 0.0}
    for name, want in theirs["consolidated"].items():
        if want.is_floating_point():
            d = (ours["consolidated"][name] - want).abs()
            diff["weight_abs"] = max(diff["weight_abs"], d.max().item())
            diff["weight_rel"] = max(diff["weight_rel"], (d / want.abs().clamp_min(1e-12)).max().item())
    return diff


def _assert_same_training(ours, theirs):
    assert len(ours["losses"]) == len(theirs["losses"])
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=RTOL, atol=ATOL)
    assert set(ours["consolidated"]) == set(theirs["consolidated"])
    for name, want in theirs["consolidated"].items():
        got = ours["consolidated"][name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=name)
        else:
            assert torch.equal(got, want), name  # BatchNorm's num_batches_tracked
    torch.testing.assert_close(ours["outputs"], theirs["outputs"], rtol=RTOL, atol=ATOL)


def _compare_with_torch_xla(tmp_path, case, num_cores=None):
    procs = {ours: _start(tmp_path, case, ours, num_cores) for ours in (True, False)}  # both at once: 2 cores
    (rc, log, mine), (rc_t, log_t, want) = (_finish(*procs[True]), _finish(*procs[False]))
    assert rc_t == 0, "torch_xla's own FSDP failed (the control):\n" + log_t[-4000:]
    assert want["fsdp_class"].startswith("torch_xla."), want["fsdp_class"]
    _check_run(case, rc, log, mine, procs[True][1])
    print(f"\n{case.id}: max differences from torch_xla {_max_differences(mine, want)}")
    _assert_same_training(mine, want)


def test_example_with_imports_swapped_trains_like_torch_xla(tmp_path):
    """Nested units with checkpointing, flattened, dim 0, pinned, fp32 reduce-scatter: same losses,
    same consolidated weights and BatchNorm statistics as torch_xla's FSDP. --num_cores 1 (xmp.spawn's
    in-process path) saves a child interpreter per library; the slow matrix spawns one."""
    _compare_with_torch_xla(tmp_path, DEFAULT, num_cores=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", F32_MATRIX, ids=lambda c: c.id)
def test_example_flag_matrix_trains_like_torch_xla(tmp_path, case):
    _compare_with_torch_xla(tmp_path, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.id)
def test_example_in_bfloat16_trains_with_ours(tmp_path, case):
    proc, out = _start(tmp_path, case, ours=True)
    _check_run(case, *_finish(proc, out), out)


@pytest.mark.slow
def test_torch_xla_cannot_run_the_example_in_bfloat16(tmp_path):
    """Why bfloat16 is not compared: torch_xla's FSDP stops at the first step on this model."""
    proc, out = _start(tmp_path, BF16_CASES[0], ours=False)
    rc, log, _ = _finish(proc, out)
    assert rc != 0 and TORCH_XLA_BF16_ERROR in log, log[-4000:]
