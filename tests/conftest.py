"""Test-suite setup: tests import their helpers (parity_cases, ...) from this folder."""
import os
import sys

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
