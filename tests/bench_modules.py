"""Import a script of bench/ (not a package) by its module name, for tests of its helpers."""
import importlib
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load(name: str):
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
