"""Every environment variable xla_fsdp reads is named and read in one module
(xla_fsdp/runtime/environment.py), listed in docs/environment.md, and torch_xla's SPMD switch is
read as torch_xla reads it (issue 80, "One runtime decision")."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from xla_fsdp.runtime import environment

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "xla_fsdp" / "runtime" / "environment.py"
# the one line a script writes to declare its runtime: run_clm declares it as users' scripts do
DECLARES_ITS_RUNTIME = ROOT / "launch" / "run_clm.py"
MAX_OWN_NAMES = 12
OURS = re.compile(r"XLA_FSDP_[A-Z0-9_]+")
# torch_xla's SPMD switch and our runtime: spelled (and so read) nowhere else
DECIDERS = (environment.RUNTIME, environment.TORCH_XLA_SPMD)


def modules():
    return sorted(p for folder in ("xla_fsdp", "launch") for p in (ROOT / folder).rglob("*.py"))


def test_our_variable_names_are_spelled_in_one_module():
    spelled = {}
    for path in modules():
        for name in OURS.findall(path.read_text(encoding="utf-8")):
            spelled.setdefault(path.relative_to(ROOT).as_posix(), set()).add(name)
    home = HOME.relative_to(ROOT).as_posix()
    elsewhere = {p: names for p, names in spelled.items() if p != home
                 and not (p == DECLARES_ITS_RUNTIME.relative_to(ROOT).as_posix() and names == {environment.SCRIPT_MARKER})}
    assert not elsewhere, f"XLA_FSDP_* names spelled outside {home}: {elsewhere}; import them from it"
    own = {v.name for v in environment.VARIABLES if v.name.startswith("XLA_FSDP_")}
    assert spelled[home] == own | set(environment.REMOVED), spelled[home] ^ (own | set(environment.REMOVED))
    assert len(own) <= MAX_OWN_NAMES, sorted(own)


def test_the_runtime_and_torch_xlas_spmd_switch_are_named_in_one_module():
    for path in modules():
        if path == HOME:
            continue
        text = path.read_text(encoding="utf-8")
        for name in DECIDERS:
            assert not re.search(rf"\b{name}\b", text), f"{path.relative_to(ROOT)} names {name}: ask environment.py"


def _reads(tree: ast.AST):
    """os.environ.get(...) / environ.get(...) / os.getenv(...) / os.environ[...] loads."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr == "getenv" and isinstance(owner, ast.Name) and owner.id == "os":
                yield node.lineno
            if node.func.attr == "get" and (
                    (isinstance(owner, ast.Attribute) and owner.attr == "environ")
                    or (isinstance(owner, ast.Name) and owner.id == "environ")):
                yield node.lineno
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "environ"):
            yield node.lineno


def test_no_other_module_reads_the_environment():
    found = {}
    for path in modules():
        if path == HOME:
            continue
        lines = sorted(set(_reads(ast.parse(path.read_text(encoding="utf-8")))))
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines
    assert not found, f"environment variables read outside environment.py (ask environment.get): {found}"


def test_the_docs_table_lists_every_variable_and_no_other():
    text = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", text, flags=re.M))
    assert documented == {v.name for v in environment.VARIABLES}, documented ^ {v.name for v in environment.VARIABLES}
    for v in environment.VARIABLES:
        row = re.search(rf"^\| `{v.name}` \|(.*)$", text, flags=re.M).group(1)
        assert ("internal" in row) == v.internal, (v.name, row)


@pytest.mark.parametrize("value", ["1", "2", "true", "0", "", "false", "yes", "on", "TRUE", " 1"])
def test_torch_xlas_spmd_switch_is_read_as_torch_xla_reads_it(value, monkeypatch):
    """torch_xla's own reading (`torch_xla.runtime.is_spmd` before use_spmd(): its check_env_flag)
    is the reference: the launcher, the job and the check choose the single controller exactly
    when torch_xla will be in SPMD mode."""
    import torch_xla.utils.utils as xu

    monkeypatch.setenv(environment.TORCH_XLA_SPMD, value)
    monkeypatch.delenv(environment.RUNTIME, raising=False)
    theirs = xu.check_env_flag(environment.TORCH_XLA_SPMD)
    assert (environment.runtime() == environment.SINGLE_CONTROLLER) == theirs


def test_a_runtime_that_is_none_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(environment.RUNTIME, "single")
    with pytest.raises(ValueError, match=f"{environment.RUNTIME}='single': expected 'single_controller'"):
        environment.runtime()
    monkeypatch.setenv(environment.RUNTIME, "Multi_Process")
    assert environment.runtime() == environment.MULTI_PROCESS


def test_a_removed_variable_is_refused_with_what_replaces_it(monkeypatch):
    (name, instead), = environment.REMOVED.items()
    monkeypatch.setenv(name, "spmd")
    with pytest.raises(ValueError, match=f"{name} is no longer read"):
        environment.refuse_removed()
    monkeypatch.delenv(name)
    environment.refuse_removed()
