"""Test-suite setup: tests import their helpers (parity_cases, ...) from this folder."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PJRT_DEVICE", "CPU")
