"""The async-collective libtpu flags xla_fsdp sets on a TPU: where they are set, and that each
one changes the program libtpu's compiler makes of our single-controller step on v4-8.

The compile tests trace the tiny GPT-2 step once (single controller, 4 devices) and compile
the traced module with libtpu 0.0.21 under different LIBTPU_INIT_ARGS; nothing is mocked.
"""
from __future__ import annotations

import dataclasses
import json
import importlib.util
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402

from xla_fsdp.tpu import libtpu_flags as lf  # noqa: E402


def test_set_on_a_tpu_only_and_never_over_the_users_own():
    env = {"PJRT_DEVICE": "TPU"}
    assert lf.set_defaults(env) == lf.at_start(lf.DEFAULT_INIT_ARGS) and env[lf.ENV] == lf.at_start(lf.DEFAULT_INIT_ARGS)
    for flag, value in lf.ASYNC_COLLECTIVES.items():
        assert f"--{flag}={value}" in env[lf.ENV].split()
    # libtpu's log unbuffered, a start-up flag: in LIBTPU_INIT_ARGS, never in a compile's flags
    assert "--logbuflevel=-1" in env[lf.ENV].split()
    assert not any("logbuflevel" in lf.for_runtime(r, c) for r in ("single_controller", "multi_process", None)
                   for c in (None, 8, 64, 256))
    mine = {"PJRT_DEVICE": "TPU", lf.ENV: "--xla_tpu_enable_async_collective_fusion=false"}
    assert lf.set_defaults(mine) is None and mine[lf.ENV] == "--xla_tpu_enable_async_collective_fusion=false"
    cpu = {"PJRT_DEVICE": "CPU"}
    assert lf.set_defaults(cpu) is None and lf.ENV not in cpu


def test_the_single_controller_gets_its_own_budget_even_when_declared_after_an_import():
    """Rings under a 50% scheduler budget for the single controller ([Note: rings by default on
    a TPU]), 90% on larger slices; 70% otherwise. Flags xla_fsdp set before the runtime was known are re-decided
    (the launcher imports xla_fsdp before it chooses); the user's never are."""
    assert "--xla_tpu_scheduler_percent_shared_memory_limit=50" in lf.SINGLE_CONTROLLER_INIT_ARGS.split()
    assert "--xla_tpu_scheduler_percent_shared_memory_limit=70" in lf.DEFAULT_INIT_ARGS.split()
    env = {"PJRT_DEVICE": "TPU"}
    assert lf.set_defaults(env) == lf.at_start(lf.DEFAULT_INIT_ARGS)  # the runtime not known yet
    env["XLA_FSDP_RUNTIME"] = "single_controller"
    assert lf.set_defaults(env) == lf.at_start(lf.SINGLE_CONTROLLER_INIT_ARGS) and env[lf.ENV] == lf.at_start(lf.SINGLE_CONTROLLER_INIT_ARGS)
    spmd = {"PJRT_DEVICE": "TPU", "XLA_USE_SPMD": "1"}
    assert lf.set_defaults(spmd) == lf.at_start(lf.SINGLE_CONTROLLER_INIT_ARGS)
    per_chip = {"PJRT_DEVICE": "TPU", "XLA_FSDP_RUNTIME": "multi_process"}
    assert lf.set_defaults(per_chip) == lf.at_start(lf.DEFAULT_INIT_ARGS)
    pod = {"PJRT_DEVICE": "TPU", "XLA_FSDP_RUNTIME": "single_controller", lf.CHIPS_ENV: json.dumps({"chips": 32})}
    assert lf.set_defaults(pod) == lf.at_start(lf.POD_GATHERS_INIT_ARGS)  # no rings on a pod: [Note: the scheduler's budget on pods]
    assert "--xla_tpu_scheduler_percent_shared_memory_limit=90" in lf.POD_GATHERS_INIT_ARGS.split()
    one_host = {"PJRT_DEVICE": "TPU", "XLA_FSDP_RUNTIME": "single_controller", lf.CHIPS_ENV: json.dumps({"chips": 8})}
    assert lf.set_defaults(one_host) == lf.at_start(lf.SINGLE_CONTROLLER_INIT_ARGS)
    large = {"PJRT_DEVICE": "TPU", "XLA_FSDP_RUNTIME": "single_controller", lf.CHIPS_ENV: json.dumps({"chips": 128})}
    assert lf.set_defaults(large) == lf.at_start(lf.POD_INIT_ARGS)  # [Note: asynchronous staged reduce-scatters]
    assert "--xla_enable_async_reduce_scatter_fusion=true" in lf.POD_INIT_ARGS.split()
    assert set(lf.POD_GATHERS_INIT_ARGS.split()) < set(lf.POD_INIT_ARGS.split())
    assert lf.for_runtime("multi_process", 128) == lf.DEFAULT_INIT_ARGS  # pinned: nothing to fuse
    assert lf.for_runtime("single_controller", 64) == lf.POD_GATHERS_INIT_ARGS  # rings the reduce-scatters there
    users = {"PJRT_DEVICE": "TPU", lf.ENV: lf.DEFAULT_INIT_ARGS, "XLA_FSDP_RUNTIME": "single_controller"}
    assert lf.set_defaults(users) is None and users[lf.ENV] == lf.DEFAULT_INIT_ARGS  # exported by the user


def _env_after(code: str, **extra) -> str:
    env = {k: v for k, v in os.environ.items() if k != lf.ENV}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", code + f"\nimport os; print('FLAGS=' + os.environ.get('{lf.ENV}', ''))"],
                         capture_output=True, text=True, env=env, cwd=ac.ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [l for l in out.stdout.splitlines() if l.startswith("FLAGS=")][-1][len("FLAGS="):]


def test_importing_xla_fsdp_and_the_launcher_set_them_on_a_tpu():
    assert _env_after("import xla_fsdp", PJRT_DEVICE="TPU") == lf.at_start(lf.DEFAULT_INIT_ARGS)
    assert _env_after("import xla_fsdp", PJRT_DEVICE="CPU") == ""
    assert _env_after("import xla_fsdp", PJRT_DEVICE="TPU", LIBTPU_INIT_ARGS="--mine=1") == "--mine=1"
    launcher = ("import sys; sys.path.insert(0, 'launch'); import xla_spawn, os; "
                "os.environ['PJRT_DEVICE'] = 'TPU'; import xla_fsdp; xla_spawn.async_collective_flags()")
    assert _env_after(launcher) == lf.at_start(lf.DEFAULT_INIT_ARGS)
    # as xla_spawn runs run_clm: xla_fsdp imported first, the runtime declared after
    assert _env_after(launcher.replace("import xla_fsdp;", "import xla_fsdp; "
                                       "os.environ['XLA_FSDP_RUNTIME'] = 'single_controller';")) \
        == lf.at_start(lf.SINGLE_CONTROLLER_INIT_ARGS)


def test_the_launcher_counts_the_slices_chips_for_the_budget():
    import importlib
    sys.path.insert(0, os.path.join(ac.ROOT, "launch"))
    xla_spawn = importlib.import_module("xla_spawn")
    assert xla_spawn.slice_chips(4, workers=lambda: 8) == 32  # v4-64: 8 hosts of 4 chips
    assert xla_spawn.slice_chips(8, workers=lambda: 1) == 8

    def no_metadata():
        raise RuntimeError("no TPU metadata server")

    assert xla_spawn.slice_chips(4, workers=no_metadata) == 0


def test_importing_xla_fsdp_after_the_runtime_started_warns_instead():
    """libtpu reads its flags once: set after the runtime started they would do nothing."""
    code = ("import os, warnings, torch_xla; torch_xla.device(); os.environ['PJRT_DEVICE'] = 'TPU'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); import xla_fsdp\n"
            "print('WARNED=' + str(any('runtime started before xla_fsdp' in str(x.message) for x in w)))")
    env = {k: v for k, v in os.environ.items() if k != lf.ENV}
    env["PJRT_DEVICE"] = "CPU"
    out = subprocess.run([sys.executable, "-c", code + f"\nprint('FLAGS=' + os.environ.get('{lf.ENV}', ''))"],
                         capture_output=True, text=True, env=env, cwd=ac.ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WARNED=True" in out.stdout and "FLAGS=\n" in out.stdout + "\n", out.stdout


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="the TPU compiler comes with `pip install -e .[tpu-aot]`")


@pytest.fixture(scope="module")
def traced_step(tmp_path_factory):
    """The tiny single-controller step traced at v4-8's 4 devices (the check's --dump), with
    all-gathers and staged reduce-scatters (where rings do not apply), which the flags act on."""
    tmp = tmp_path_factory.mktemp("flags")
    case = ac.BY_NAME["sc-full_shard"]
    case = dataclasses.replace(case, settings={**case.settings, "all_gather_impl": "all_gather",
                                               "reduce_scatter_stages": "axes"})
    cmd = ac.command(case, 4, str(tmp / "fsdp.json"), str(tmp / "out"))
    return COMPILES.trace(cmd, str(tmp / "dump"), {}, runtime=case.runtime)  # compiled with no flags


COMPILES = ac.Compiles("v4-8")  # each program compiled once per flag set, the check's own compile included
_compile = COMPILES.compile


def _program(r: dict) -> str:
    """The optimized program without its metadata (names of source lines and such)."""
    import re
    return re.sub(r", metadata=\{[^}]*\}", "", r["optimized_hlo"])


@needs_libtpu
def test_the_flags_make_v4_run_our_gathers_asynchronously_beside_matmuls(traced_step):
    off, on = _compile(traced_step, {}), _compile(traced_step, dict(lf.ASYNC_COLLECTIVES))
    assert off["collectives"]["async"] == 0, off["collectives"]  # libtpu's v4 default: all synchronous
    gathers = on["collectives"]["by_kind"]["all-gather"]
    assert gathers["async"] > 0 and gathers["async_with_matmul"] > 0, on["collectives"]
    assert on["collectives"]["sent_async_with_matmul_fraction"] > 0.1, on["collectives"]
    assert on["projection"]["async_collective_seconds"] > 0


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("flag", sorted(f for f in lf.ASYNC_COLLECTIVES
                                         if "memory_limit" not in f and "prefer_async_allgather" not in f))
def test_each_flag_changes_the_program(traced_step, flag):
    """The memory limit binds only where the overlap would overflow HBM: its effect is shown
    by `python bench/tpu_perf_table.py` on the 2B step (does not fit without it). The
    all-gather preference acts on slices spanning three torus axes only: its test is
    tests/test_tpu_large_slice.py (v4-128)."""
    every = _program(_compile(traced_step, dict(lf.ASYNC_COLLECTIVES)))
    without = _program(_compile(traced_step, {k: v for k, v in lf.ASYNC_COLLECTIVES.items() if k != flag}))
    assert without != every, f"dropping --{flag} leaves the optimized program unchanged: it does nothing here"


# A dropout's random bits under the SPMD partitioner: tiled over the 4 chips of a v4-8, and tiled
# over 2 with each tile on 2 chips (partially replicated)
_RANDOM_BITS = """HloModule random_bits, entry_computation_layout={{(u64[2]{{0}})->u32[64,128]{{1,0}}}}

ENTRY e {{
  s = u64[2]{{0}} parameter(0), sharding={{replicated}}
  r = (u64[2]{{0}}, u32[64,128]{{1,0}}) rng-bit-generator(s), algorithm=rng_default, sharding={{{{replicated}}, {sharding}}}
  ROOT o = u32[64,128]{{1,0}} get-tuple-element(r), index=1, sharding={sharding}
}}
"""


def _random_bits_program(sharding: str, flags: str) -> str:
    from xla_fsdp.aot.cli import _load_compiler
    from xla_fsdp.tpu import compile_options as co
    from xla_fsdp.tpu import topology

    spec = topology.parse_accelerator_type("v4-8")
    compiler = _load_compiler()
    with compiler.topology(spec.topology_name, spec.options) as top:
        out = compiler.compile(top, co.hlo_text_to_proto(_RANDOM_BITS.format(sharding=sharding)),
                               co.spmd_options(top.device_ids, co.parse_libtpu_init_args(flags)))
    return out.optimized_hlo


@needs_libtpu
def test_random_bits_are_drawn_per_chip_and_equal_on_replicas():
    """[Note: random bits per chip] in xla_fsdp/tpu/libtpu_flags.py."""
    import re

    def generated(program):  # the shape each chip draws, and the per-tile offsets of the state
        shape = re.search(r"= (u32\[[0-9,]+\])\S* rng-bit-generator\(", program).group(1)
        table = re.search(r"u32\[4\]\S* constant\(\{([0-9, ]+)\}\)", program)
        return shape, [int(v) for v in table.group(1).split(",")] if table else None

    tiled, halves = "{devices=[4,1]<=[4]}", "{devices=[2,1,2]<=[4] last_tile_dim_replicate}"
    assert generated(_random_bits_program(tiled, ""))[0] == "u32[64,128]"  # libtpu's default: the whole
    for flags in (lf.SINGLE_CONTROLLER_INIT_ARGS, lf.DEFAULT_INIT_ARGS):
        shape, offsets = generated(_random_bits_program(tiled, flags))
        assert shape == "u32[16,128]" and len(set(offsets)) == 4, (shape, offsets)  # its own bits per chip
        shape, offsets = generated(_random_bits_program(halves, flags))
        assert shape == "u32[32,128]", shape
        assert offsets[0] == offsets[1] and offsets[2] == offsets[3] and offsets[0] != offsets[2], offsets


@needs_libtpu
def test_a_start_up_flag_given_per_compile_is_named_with_the_way_out(traced_step):
    """libtpu reads some flags only when it starts (xla_jf_internal_num_threads): given to the
    check as compile flags, libtpu refuses them; the report says where they go instead."""
    from xla_fsdp.aot import report
    from xla_fsdp.aot.cli import _load_compiler
    from xla_fsdp.tpu import topology

    r = report.check_program(traced_step, topology.parse_accelerator_type("v4-8"), _load_compiler(),
                             "--xla_jf_internal_num_threads=2", say=lambda *a: None)
    assert not r["compiles"] and "xla_jf_internal_num_threads" in r["error"]
    assert "LIBTPU_INIT_ARGS" in r["cause"] and "--libtpu-flags" in r["cause"], r["cause"]


@needs_libtpu
def test_start_up_flags_from_libtpu_init_args_apply_and_the_step_still_compiles(traced_step):
    """A user who sets LIBTPU_INIT_ARGS for libtpu's dumps gets them (libtpu read them when it
    started) and the check still compiles with the rest: the start-up flag is left out of the
    compile's flags and named; given explicitly (--libtpu-flags) it still fails as above."""
    from xla_fsdp.aot import report
    from xla_fsdp.aot.cli import _load_compiler
    from xla_fsdp.tpu import topology

    r = report.check_program(traced_step, topology.parse_accelerator_type("v4-8"), _load_compiler(),
                             "--xla_jf_internal_num_threads=2 --xla_enable_async_all_gather=true",
                             say=lambda *a: None, started_with=True)
    assert r["compiles"], r["error"][:2000]
    assert r["start_up_flags"] == ["xla_jf_internal_num_threads"], r.get("start_up_flags")
    assert "xla_jf_internal_num_threads" in report.render(r)
