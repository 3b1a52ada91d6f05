"""Where an instruction of a compiled program came from: the op and the Python line torch_xla wrote in its metadata
(XLA_HLO_DEBUG=1, as the check traces), and the function that line is in. The optimized program keeps the metadata
of the instructions it was made from (a fusion: its root's), so a kernel can be named by the layer or block that
issued it, and a ring's collective-permute by its ring ([Note: which ring a permute belongs to] in
xla_fsdp/collective_engine/ring.py).
"""
from __future__ import annotations

import ast
import functools
import os
import re
from typing import Optional, Tuple

from xla_fsdp.tpu.optimized_hlo import group

_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')
_OP_TYPE = re.compile(r'op_type="([^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
RING_FILE = "/collective_engine/ring.py"  # where the engine's rings are written
# the functions each ring of xla_fsdp/collective_engine/ring.py issues its rotation from
RING_STEPS = {"_summing_step": "reduce-scatter", "_gathering_step": "all-gather"}


@functools.lru_cache(maxsize=128)
def _functions(path: str) -> Tuple[Tuple[int, int, str], ...]:
    """(first line, last line, "Class.function") of every function in a source file."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ()
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.lineno, child.end_lineno or child.lineno, prefix + child.name))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return tuple(out)


def function_at(path: str, line: int) -> str:
    """The innermost function (Class.method) holding `line` of `path` ("" when none or unreadable)."""
    inside = [name for first, last, name in _functions(path) if first <= line <= last]
    return inside[-1] if inside else ""


def source(rest: str) -> Optional[Tuple[str, int]]:
    m = _SOURCE.search(rest)
    return (m.group(1), int(m.group(2))) if m else None


def op_type(rest: str) -> str:
    return group(_OP_TYPE, rest)


def op_name(rest: str) -> str:
    return group(_OP_NAME, rest)


def describe(rest: str) -> str:
    """"op @ file.py:line (Class.method)" from an instruction's metadata ("" without any)."""
    op, where = op_type(rest), source(rest)
    if where is None:
        return op
    fn = function_at(*where)
    text = f"{os.path.basename(where[0])}:{where[1]}" + (f" ({fn})" if fn else "")
    return (op + " @ " if op else "") + text


def ring_kind(rest: str) -> Optional[str]:
    """"reduce-scatter" or "all-gather" for a ring's collective-permute, else None."""
    where = source(rest)
    if where is None or not where[0].endswith(RING_FILE):
        return None
    return RING_STEPS.get(function_at(*where).rsplit(".", 1)[-1])
