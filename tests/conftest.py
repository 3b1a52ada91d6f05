"""Test-suite setup: tests import their helpers (parity_cases, ...) from this folder."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PJRT_DEVICE", "CPU")


def pytest_sessionstart(session):
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
