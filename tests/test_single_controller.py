"""The collective engine's single-controller runtime, executed on 4 and 8 XLA:CPU devices.

One process drives every device (torch_xla's SPMD runtime); each unit gathers
and reduce-scatters with the engine's explicit pinned collectives inside an
SPMD manual-sharding region ([Note: single-controller runtime]). This is the
only place the XLA collectives run with more than one participant on a
machine without a TPU.

Each scenario runs tests/single_controller/run.py in a fresh process (SPMD
mode and the device count are fixed when the runtime starts); all scenarios
are started by one fixture and each test waits for its own.

Parity: the model takes the global batch of 8; per-step losses and the full
parameters (cut from the global dim-0 padded tensors) after 5 steps must equal
the unsharded eager model trained on the same batch: fp32 losses within 1e-5
relative and parameters within 1e-5 tensor-relative; bf16 compute within 3e-2
(losses) and 2e-2 (parameters), as in the gloo suite. The default run covers
the shipped TPU configuration's variants, HYBRID and deferred init once (the other
strategies run in the gloo suite's default run; combinations of the variants, such as bf16 with
scan, under `-m slow`); `pytest -m slow` runs the whole matrix at both device
counts with both gather implementations.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity_cases import MATRIX, MIXED_LAYOUTS, assemble, assert_rel_close

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "single_controller" / "run.py"

FP32 = dict(rtol=1e-5, atol=1e-6)
FP32_PARAM_REL = 1e-5
BF16 = dict(rtol=3e-2, atol=3e-2)
BF16_PARAM_REL = 2e-2
# gloo (eager CPU kernels) against XLA:CPU: all parameters as one vector within 1e-6
# (measured <= 3.2e-7); each tensor within 2e-6, because GPT-2's key bias has a
# mathematically zero gradient whose rounding noise AdamW scales by 1/eps in both
# runs (measured 1.01e-6 for c_attn.bias; see parity_cases.make_optimizer)
CROSS_RUNTIME_MODEL_REL = 1e-6
CROSS_RUNTIME_TENSOR_REL = 2e-6

# one of each variant in the default run: (devices, "case[:gather impl]")
# (reshard off: SHARD_GRAD_OP; HYBRID at 8 only)
DEFAULT = {
    4: ["mlp_sgd", "gpt2_ckpt_no_prefetch", "mlp_bf16", "mlp_clip_sgd:all_reduce", "acc/no_sync/mlp_nested_adamw",
        "gpt2_ckpt_scan"],
    8: ["gpt2_hybrid", "meta", "gpt2_ckpt_scan@ring:ring"],
}  # gpt2_ckpt_scan*: scan_layers, the blocks as one XLA loop holding the engine's collectives  # gpt2_ckpt_no_prefetch is the 2B v4 job's config (per-layer checkpointing, no prefetch: gpt2_checkpoint and
# gpt2_no_prefetch in one run). mlp_mixed_sizes, mlp_shard_grad_op and gpt2_no_shard (all three in the
# gloo suite's default run), gpt2_txla_ckpt_after (also at XLA world 1), gpt2_adamw (GPT-2 with AdamW
# stays: gpt2_ckpt_no_prefetch, and with rings at 8 devices), gpt2_checkpoint, gpt2_no_prefetch and accumulation
# on GPT-2 run in the sweep (-m slow), as every case does
# the rest runs with `pytest -m slow`: every case, both gather implementations, every accumulation mode
# the combinations of variants above, behind -m slow: the shipped bf16 scan config (gpt2_ckpt_scan_bf16;
# bf16 stays in the default run as mlp_bf16, scan as gpt2_ckpt_scan) and its unscanned twin, scan with HYBRID
# (gpt2_hybrid), torus stages off the token chain (stages: gpt2_small_sgd; token_chain="off" against the
# unsharded run: tests/test_run_clm_llama.py's collectives_scan, SLOW_TORUS_CASES below). One more worker
# per device count, started when a test first asks for one of them.
SLOW = {4: ["gpt2_ckpt_bf16", "gpt2_ckpt_scan_bf16"], 8: ["gpt2_ckpt_scan_hybrid"]}
SWEEP = {n: [f"{c.name}:{impl}" for c in MATRIX for impl in ("all_gather", "all_reduce")]
         + [f"acc/{mode}/{case}" for mode in ("no_sync", "requires_sync", "shards") for case in ("gpt2_adamw", "gpt2_hybrid")]
         for n in (4, 8)}


class Run:
    """One worker process; `result()` waits for it and loads what it saved."""

    def __init__(self, devices: int, mode: str, out: Path, args=(), env=None):
        self.out = out
        full_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), **(env or {}))
        full_env.pop("XLA_USE_SPMD", None)
        self.proc = subprocess.Popen([sys.executable, str(WORKER), mode, str(out), *args], cwd=ROOT,
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._result = None

    def result(self):
        if self._result is None:
            log, _ = self.proc.communicate(timeout=1800)
            assert self.proc.returncode == 0, f"worker failed:\n{log[-6000:]}"
            self._result = torch.load(self.out, weights_only=False)
        return self._result


def _start(tmp: Path, cases_by_devices):
    runs = {}
    for devices, cases in cases_by_devices.items():
        extra = [c.name for c in MIXED_LAYOUTS] if devices == 4 else TORUS_CASES + RING_CASES + POD_CASES
        # at 8: the devices stand for a 2x2x2 v4 slice ([Note: one reduce-scatter per torus axis])
        runs[("parity", devices)] = Run(devices, "parity", tmp / f"parity{devices}.pt", cases + extra,
                                        env=TORUS_ENV if devices == 8 else None)
    dump = tmp / "dump"
    runs["program"] = Run(8, "program", tmp / "program.pt", env={
        "DUMP_DIR": str(dump),
        # the per-device program right after SPMD partitioning, before XLA:CPU's own passes
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning "
                     "--xla_dump_hlo_module_re=SyncTensorsGraph --xla_dump_hlo_pipeline_re=spmd-partitioner"})
    runs["compiles"] = Run(8, "compiles", tmp / "compiles.pt")
    runs["errors"] = Run(4, "errors", tmp / "errors.pt")
    runs["late_spmd"] = Run(4, "late_spmd", tmp / "late.pt")
    runs["state_dicts"] = Run(4, "state_dicts", tmp / "state_dicts.pt")
    return runs


# at 8 devices, whose parity run stands for a 2x2x2 slice (the small GPT-2: buckets of 8 rows of 128 or
# more per device, which stage; each case counts its own reduce-scatters, tests/single_controller/run.py)
# "+off": token_chain="off", as the shipped Llama config ([Note: collectives off the chain])
TORUS_CASES = ["gpt2_small_sgd"]
SLOW_TORUS_CASES = ["gpt2_small_sgd+off"]  # -m slow
TORUS_ENV = {"XLA_FSDP_TORUS": "2x2x2"}
RING_CASES = ["gpt2_adamw@ring:ring",  # the same, reduce_scatter_stages and all_gather_impl "ring"
              "mlp_tiles@ring:ring"]  # its large shards whole fp32 tiles: gathered in their own shape
# a pod's default: reduce-scatters as rings, gathers as all-gathers ([Note: reduce-scatter rings on pods])
POD_CASES = ["gpt2_adamw@ring:all_gather"]


class Runs(dict):
    """The default run's workers, started together; the SLOW cases' worker at a device count is
    started when a test first asks for it."""

    def __init__(self, tmp: Path):
        super().__init__(_start(tmp, DEFAULT))
        self.tmp = tmp

    @staticmethod
    def slow_specs(devices: int) -> list:
        return SLOW[devices] + (SLOW_TORUS_CASES if devices == 8 else [])

    def __missing__(self, key):
        kind, devices = key
        assert kind == "parity_slow", key
        self[key] = Run(devices, "parity", self.tmp / f"parity{devices}_slow.pt", self.slow_specs(devices),
                        env=TORUS_ENV if devices == 8 else None)
        return self[key]

    def parity(self, devices: int, spec: str) -> dict:
        """The parity worker's result for `spec` at `devices`."""
        kind = "parity_slow" if spec in self.slow_specs(devices) else "parity"
        return self[(kind, devices)].result()[spec]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("single_controller"))


def _check_parity(spec: str, got: dict) -> None:
    bf16 = "bf16" in spec
    tol, rel = (BF16, BF16_PARAM_REL) if bf16 else (FP32, FP32_PARAM_REL)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["ref_losses"]), **tol)
    for name, want in got["ref_params"].items():
        assert_rel_close(got["params"][name], want, rel, f"{spec} {name}")
    # really sharded: every global tensor is the parameter padded to a multiple of the group size
    size = len(got["groups"][0])
    for name, want in got["ref_params"].items():
        rows = want.shape[0] if want.dim() else 1
        assert got["padded_shapes"][name][0] == -(-rows // size) * size, name


@pytest.mark.parametrize("devices,spec", [(n, c) for n, cs in DEFAULT.items() for c in cs if c != "meta"]
                         + [pytest.param(n, c, marks=pytest.mark.slow) for n, cs in SLOW.items() for c in cs],
                         ids=lambda x: str(x))
def test_parity(runs, devices, spec):
    _check_parity(spec, runs.parity(devices, spec))


@pytest.mark.parametrize("devices,scanned,unscanned", [
    (4, "gpt2_ckpt_scan", "gpt2_ckpt_no_prefetch"),
    pytest.param(4, "gpt2_ckpt_scan_bf16", "gpt2_ckpt_bf16", marks=pytest.mark.slow),
    (8, "gpt2_ckpt_scan@ring:ring", "gpt2_adamw@ring:ring")], ids=lambda x: str(x))
def test_scanned_blocks_train_as_the_unscanned_run(runs, devices, scanned, unscanned):
    """scan_layers on the collectives engine ([Note: scanning units of the collectives engine]):
    the blocks run as one XLA loop whose body gathers and reduce-scatters with the engine's own
    collectives; losses and parameters after 5 steps equal the unscanned run's within 1e-5 (and
    the unsharded reference's, test_parity)."""
    a, b = runs.parity(devices, scanned), runs.parity(devices, unscanned)
    assert "transformer.h_scan.attn.c_attn.weight" in a["stacked"], a["stacked"]  # stored stacks
    # fp32: within 1e-5. bf16: the stored stacks' optimizer update and clipping norm round their
    # fp32 sums in another order, and bf16 compute turns last-bit differences of a parameter into
    # bf16 rounding flips (measured 2026-11-29: losses within 2.9e-5, parameters within 1.1e-3,
    # where the bf16 runs are 1.8e-2 from the fp32 reference, test_parity)
    loss_rel, param_rel = (1e-4, 5e-3) if "bf16" in scanned else (1e-5, 1e-5)
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=loss_rel, atol=1e-6)
    for name, want in b["params"].items():
        assert_rel_close(a["params"][name], want, param_rel, f"{scanned} {name}")
    if "ring" not in scanned:  # the two blocks' reduce-scatter is traced once a step: the loop's body
        assert a["scatter_calls"] * 3 == b["scatter_calls"] * 2, (a["scatter_calls"], b["scatter_calls"])


@pytest.mark.parametrize("name", [c.name for c in MIXED_LAYOUTS])
def test_nested_units_with_different_layouts(runs, name):
    """A NO_SHARD unit in a FULL_SHARD root and the reverse, clipping active, at 4 devices."""
    got = runs[("parity", 4)].result()[name]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["ref_losses"]), **FP32)
    for param, want in got["ref_params"].items():
        assert_rel_close(got["params"][param], want, FP32_PARAM_REL, f"{name} {param}")


@pytest.mark.parametrize("spec", TORUS_CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_TORUS_CASES])
def test_reduce_scatter_in_stages_along_the_torus_axes(runs, spec):
    """On a slice whose devices span three axes the engine reduce-scatters one axis at a time
    (three reduce-scatters over pairs on 2x2x2); parameters still match the unsharded run."""
    at8 = runs[("parity", 8)].result()
    got = runs.parity(8, spec)
    sizes = {count for count, _ in got["scatter_sizes"]}
    assert 2 in sizes and sizes <= {2, 8}, got["scatter_sizes"]
    # flat only for buckets that do not split into 8 or more whole rows of 128 per device
    # ([Note: 2-D reduce-scatter]: an all-reduce on a TPU either way)
    assert all(numel % (8 * 128) or numel // (8 * 128) < 8
               for count, numel in got["scatter_sizes"] if count == 8), got["scatter_sizes"]
    _check_parity(spec, got)
    # two groups of 4 (HYBRID): flat, each its own half; at 4 devices with no torus: flat
    assert {count for count, _ in at8["gpt2_hybrid"]["scatter_sizes"]} == {4}
    assert {count for count, _ in runs[("parity", 4)].result()["mlp_sgd"]["scatter_sizes"]} == {4}


@pytest.mark.parametrize("spec", RING_CASES)
def test_reduce_scatter_as_rings_of_neighbour_exchanges(runs, spec):
    """reduce_scatter_stages="ring" and all_gather_impl="ring" on 2x2x2: no reduce-scatter or
    all-gather is issued (the partitioner's collective-permutes carry gradients and parameters,
    [Note: ring reduce-scatter]); parameters match the unsharded run at fp32 tolerance."""
    got = runs[("parity", 8)].result()[spec]
    assert got["scatter_sizes"] == [], got["scatter_sizes"]
    assert got["gathers"] == 0  # all_gather_impl="ring": the gathers are rings too
    assert runs[("parity", 8)].result()["gpt2_small_sgd"]["gathers"] > 0  # what counts them sees the others
    _check_parity(spec, got)


def test_ring_gathers_whole_tiles_in_the_shards_own_shape(runs):
    """[Note: ring gathers in the shard's shape]: the weights whose shards are whole (8, 128) fp32
    tiles ([256, 128] -> [32, 128] per device, [128, 256] -> [16, 256]) travel the rings in that
    shape, the rest flat as [rows, 128]; parameters match the unsharded run (checked above)."""
    got = runs[("parity", 8)].result()
    assert (16, 256) in got["mlp_tiles@ring:ring"]["ring_gathers"], got["mlp_tiles@ring:ring"]["ring_gathers"]
    # the tiny GPT-2's shards are not whole tiles (or share buckets): all flat
    assert {shape[1] for shape in got["gpt2_adamw@ring:ring"]["ring_gathers"]} == {128}


@pytest.mark.parametrize("spec", POD_CASES)
def test_reduce_scatter_rings_beside_all_gathers(runs, spec):
    """A pod's default on 2x2x2: gradients travel by rings (no reduce-scatter issued), parameters
    by all-gathers; parameters match the unsharded run at fp32 tolerance."""
    got = runs[("parity", 8)].result()[spec]
    assert got["scatter_sizes"] == [], got["scatter_sizes"]
    assert got["gathers"] > 0
    _check_parity(spec, got)


def test_hybrid_groups_are_the_halves(runs):
    assert runs[("parity", 8)].result()["gpt2_hybrid"]["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# the cases the gloo suite also runs at world 4 (tests/conftest.py's dist_results)
CROSS_RUNTIME = [c for c in DEFAULT[4] if "bf16" not in c and "/" not in c
                 and 4 in next(m for m in MATRIX if m.name == c.split(":")[0]).worlds]


@pytest.fixture(scope="module")
def gloo_world_4(tmp_path_factory):
    """The CROSS_RUNTIME cases trained on gloo at world 4, each rank's results: the cases of
    conftest's dist_results this file compares, without the rest of its matrix (pytest-xdist may
    run this file in the other worker, where the whole matrix would be trained a second time)."""
    from parity_cases import run_distributed

    names = {spec.split(":")[0] for spec in CROSS_RUNTIME}
    return run_distributed([c for c in MATRIX if c.name in names], 4, str(tmp_path_factory.mktemp("gloo4")))


@pytest.mark.parametrize("spec", CROSS_RUNTIME)
def test_same_parameters_as_the_multi_process_runtime(runs, gloo_world_4, spec):
    """gloo world 4 (one process per replica, each on its micro-batch) and this runtime
    at 4 devices end at the same parameters."""
    name = spec.split(":")[0]
    ranks = [r[name] for r in gloo_world_4]
    got = runs[("parity", 4)].result()[spec]
    for group in ranks[0]["groups"]:
        rebuilt = assemble(got["ref_params"], [r["shards"] for r in ranks], group)
        for pname, value in got["params"].items():
            assert_rel_close(value, rebuilt[pname], CROSS_RUNTIME_TENSOR_REL, f"{spec} {pname}")
        whole = [torch.cat([t[n].reshape(-1) for n in sorted(rebuilt)]) for t in (got["params"], rebuilt)]
        assert_rel_close(whole[0], whole[1], CROSS_RUNTIME_MODEL_REL, f"{spec} all parameters")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ranks[0]["losses"]), rtol=1e-6, atol=0)


def test_partitioned_program_holds_exactly_the_engines_collectives(runs):
    """GPT-2 (two auto-wrapped blocks and the root: 3 units) with clipping, at 8 devices,
    read from XLA's dump right after SPMD partitioning."""
    got = runs["program"].result()
    assert got["units"] == 3
    ops = got["ops"]
    # forward: one gather per unit, the root's carrying block 0's ([Note: the first gather of
    # a step]); backward: the two resharded blocks gather again (the root keeps its parameters:
    # disable_reshard_on_root); one reduce-scatter per unit; all-reduces: the mean of the loss
    # over devices and the clipping norm
    assert ops.count("all-gather") == 2 + 2, ops
    assert ops.count("reduce-scatter") == 3, ops
    assert ops.count("all-reduce") == 2, ops
    assert "all-to-all" not in ops and "collective-permute" not in ops, ops
    assert set(got["groups"]) == {"{{0,1,2,3,4,5,6,7}}"}, got["groups"]
    # one program for every device: nothing pinned, or libtpu refuses the mix with the
    # partitioner's unpinned all-reduces ([Note: no pinning in one program])
    assert got["pinned"] == 0, got


def test_at_most_two_compiles_in_twenty_steps(runs):
    got = runs["compiles"].result()
    assert got["compiles"] <= 2, got["per_step"]
    assert got["per_step"][1] == got["per_step"][-1], got["per_step"]


def test_bad_input_is_refused_by_name(runs):
    got = runs["errors"].result()
    assert "no 'fsdp' axis" in got["no_fsdp_axis"] and got["no_fsdp_axis_untouched"]
    for key in ("groups_overlap", "groups_missing", "groups_unequal"):
        assert "must split the 4 devices" in got[key], key
        assert got[key + "_untouched"], key
    assert "sharding_rank= has no meaning" in got["sharding_rank"] and got["sharding_rank_untouched"]
    assert "reduce_scatter_stages='ring' needs one shard group" in (got["ring_hybrid"] or "")
    assert got["ring_hybrid_untouched"]
    assert "input args[0] has batch size 5" in got["batch_not_divisible"]
    assert "multiple of 4" in got["batch_not_divisible"]
    assert "BatchNorm1d.num_batches_tracked" in got["buffer_in_place"]


def test_spmd_turned_on_after_wrapping_is_refused(runs):
    got = runs["late_spmd"].result()["late_spmd"]
    assert got is not None and "turned on afterwards" in got and "use_spmd() before" in got


def test_state_dicts_round_trip_and_load_into_the_plain_model(runs):
    got = runs["state_dicts"].result()
    full = got["full"]
    assert list(full) == got["keys"]  # the unwrapped model's keys, in its order
    assert full["lm_head.weight"] is full["transformer.wte.weight"]  # tie kept
    for other in ("again", "after_sharded"):  # full -> fresh model -> full; sharded -> fresh model -> full
        for key in got["keys"]:
            assert torch.equal(got[other][key], full[key]), (other, key)
    # a plain GPT-2 loaded from it computes what the sharded model computes
    torch.testing.assert_close(got["plain_logits"], got["logits"], rtol=1e-5, atol=1e-5)


def test_meta_device_model_at_8_devices(runs):
    import meta_cases

    meta_cases.check(runs[("parity", 8)].result()["meta"])


def test_gspmd_engine_returns_an_fsdp_instance_with_its_methods(runs):
    got = runs["state_dicts"].result()["gspmd"]
    assert got["is_fsdp"] and got["name"] == "FSDPSequential" and got["module_is_self"] and got["mesh"]
    assert got["clip"] > 1e-3 and got["norm_after"] == pytest.approx(1e-3, rel=1e-3)
    assert "global tensors" in got["metadata"]


@pytest.mark.parametrize("engine", ["collectives", "spmd"])
def test_meta_device_model_is_materialized_by_reset_parameters(runs, engine):
    import meta_cases

    meta_cases.check(runs["state_dicts"].result()["meta"][engine])


def test_deferred_model_is_materialized_unit_by_unit(runs):
    got = runs["state_dicts"].result()
    for key in got["keys"]:
        assert torch.equal(got["deferred"][key], got["host_per_unit"][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
def test_full_matrix(tmp_path, devices):
    """Every case of the parity matrix with both gather implementations."""
    run = Run(devices, "parity", tmp_path / "sweep.pt", SWEEP[devices])
    results = run.result()
    for spec in SWEEP[devices]:
        _check_parity(spec, results[spec])
