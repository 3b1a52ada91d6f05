"""Test-suite setup: tests import their helpers (parity_cases, ...) from this folder, and the ones
they share with bench/ (aot_cases, hlo_trace, models, ...) from bench/common."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))  # `common`
os.environ.setdefault("PJRT_DEVICE", "CPU")

# [Note: the suite compiles XLA:CPU at optimization level 0]
# Nearly all of this suite's time is XLA:CPU compiling tiny programs that then run
# a few steps; LLVM's optimizations cost more than they save there (measured: the
# run_clm world-1 test 38.8 s -> 25.2 s; the whole suite 1187 s -> 835 s). Level 0 is
# LLVM's level for XLA:CPU's machine code. XLA:CPU's MLIR fusion emitters (its default
# in torch_xla 2.9) compile slower than its older emitters, and its parallel code
# generation splits each program into modules it then compiles one at a time on this
# host: tests/single_controller/stored_stacks.py's 226 compiles took 47 s with level 0
# alone, 21 s with the older emitters, 13.5 s with one module per program as well
# (2026-12-07; wall 60 -> 26 s). The HLO assertions and the parity tests' tolerances pass
# unchanged with all three. libtpu reads XLA_FLAGS too, but its TPU program is the
# same text with them (tests/test_tpu_compiler.py::
# test_the_suites_xla_cpu_flags_leave_the_tpu_program_unchanged, with a control
# flag that does change it), so the TPU assertions judge the same program.
# Children inherit them through the environment; XLA_FSDP_TEST_OPT=1 turns them off.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                      "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("XLA_FSDP_TEST_OPT", "") != "1":
    _given = os.environ.get("XLA_FLAGS", "")
    _missing = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in _given]
    os.environ["XLA_FLAGS"] = " ".join(_missing + [_given]).strip()


def _xdist_controller(config) -> bool:
    """Whether this process is pytest-xdist's controller (`make test` runs the suite as `-n 2`): it
    runs no test, and its workers must start from the real interpreter. Were its children forked
    from its zygotes, the two workers' own zygotes would take turns on the controller's two, and
    a worker's two could share one string-hash seed."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _xdist_controller(session.config):
        return
    # child processes fork from a warm interpreter ([Note: warm interpreters] in tests/warm)
    import tempfile

    import warm

    session.config._warm_dir = tempfile.mkdtemp(prefix="xla_fsdp_warm_")
    session.config._warm_zygotes = warm.start(session.config._warm_dir)
    # The autograd engine sizes its per-device queues at its first backward; an
    # XLA device registered after a CPU-only backward trips an internal assert,
    # so bring up the (single) in-process XLA:CPU device before any test runs.
    try:
        import torch_xla
    except ImportError:
        return
    torch_xla.device()


def pytest_sessionfinish(session):
    zygotes = getattr(session.config, "_warm_zygotes", None)
    if zygotes:
        for zygote in zygotes:
            zygote.stdin.close()  # a zygote exits when the suite does
        for zygote in zygotes:
            zygote.wait(timeout=60)
        import shutil

        shutil.rmtree(session.config._warm_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory):
    """The parity matrix trained on gloo at world sizes 2 and 4 (each rank's results),
    shared by the gloo parity tests and the cross-runtime comparison."""
    from parity_cases import MATRIX, run_distributed

    out = {}
    for world in (2, 4):
        cases = [c for c in MATRIX if world in c.worlds]
        out[world] = run_distributed(cases, world, str(tmp_path_factory.mktemp(f"w{world}")))
    return out
