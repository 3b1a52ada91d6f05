"""A script of examples/ loaded by its path, for the bench jobs that set its model beside other
engines (bench/fsdp2_step.py, bench/llama_engine_job.py): the example stays a script users copy
whole, and the bench measures the example's own classes."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from . import REPO


def load(name: str) -> ModuleType:
    """examples/<name>.py as the module `name` (its `__main__` block does not run), once."""
    path = os.path.join(REPO, "examples", f"{name}.py")
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling find its classes through sys.modules
    spec.loader.exec_module(module)
    return module
