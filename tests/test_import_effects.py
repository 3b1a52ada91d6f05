"""Importing xla_fsdp patches nothing that docs/DESIGN.md does not list with its reason (issue 49).

Each scenario runs in a fresh interpreter started with `-X importtime` (tests/import_effects.py):
it first loads every torch / torch_xla / transformers module the import would load, takes a
snapshot of what could be patched (module and class attributes, os.environ, sys.meta_path, torch's
global hooks, rendezvous handlers, warning filters, signal handlers), imports ours and compares.
Every change must be a row of DESIGN.md's "Import-time effects" table, and every row must be seen
in some scenario (the table does not go stale).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tests" / "import_effects.py"
# `import xla_fsdp` on a TPU host does all it does on a CPU host and sets libtpu's flags
SCENARIOS = {"xla_fsdp on a TPU host": ("xla_fsdp", "TPU"), "xla_fsdp.fsdp": ("xla_fsdp.fsdp", "CPU")}


def listed() -> set:
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    table = design.split("### Import-time effects", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))


def _env(device: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE=device, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("LIBTPU_INIT_ARGS", "XLA_FSDP_INTERNAL"):
        env.pop(name, None)
    return env


def _start(module: str, device: str, what: str, **kwargs) -> subprocess.Popen:
    flags = ["-X", "importtime"] if what == "effects" else []
    return subprocess.Popen([sys.executable, *flags, str(TOOL), module, what], env=_env(device), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def _finish(proc: subprocess.Popen):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out, err


@pytest.fixture(scope="module")
def observed():
    """{scenario: (changes, importtime lines of the module)}; the scenarios run side by side."""
    # the widest import loads every outside module the others load: one list serves all
    modules = _finish(_start("xla_fsdp.fsdp", "CPU", "modules"))[0]
    runs = {name: _start(*args, "effects", stdin=subprocess.PIPE) for name, args in SCENARIOS.items()}
    for name, proc in runs.items():
        proc.stdin.write(modules)
        proc.stdin.close()
        proc.stdin = None
    out = {}
    for name, proc in runs.items():
        stdout, stderr = _finish(proc)
        module = SCENARIOS[name][0]
        own = [line for line in stderr.splitlines() if re.search(rf"\|\s+{re.escape(module)}$", line.rstrip())]
        out[name] = (set(json.loads(stdout.strip().splitlines()[-1])), own)
    return out


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_import_patches_nothing_unlisted(observed, scenario):
    effects, importtime = observed[scenario]
    assert importtime, "python -X importtime printed no line for the import"
    unlisted = sorted(effects - listed())
    assert not unlisted, (f"importing {SCENARIOS[scenario][0]} changes {unlisted}, which docs/DESIGN.md's "
                          "'Import-time effects' does not list: do it on first use, or list it with its reason")


def test_every_listed_effect_happens(observed):
    seen = set().union(*(effects for effects, _ in observed.values()))
    assert listed() == seen, f"listed but not seen: {sorted(listed() - seen)}"
