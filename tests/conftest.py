"""Test-suite setup: tests import their helpers (parity_cases, ...) from this folder."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PJRT_DEVICE", "CPU")


def pytest_sessionstart(session):
    # The autograd engine sizes its per-device queues at its first backward; an
    # XLA device registered after a CPU-only backward trips an internal assert,
    # so bring up the (single) in-process XLA:CPU device before any test runs.
    try:
        import torch_xla
    except ImportError:
        return
    torch_xla.device()


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
