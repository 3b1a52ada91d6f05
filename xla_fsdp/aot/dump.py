"""The traced step's module in XLA's dump: when it is whole, and taking it as `program.txt`.

[Note: the module is taken from the dump, whoever gets there first]
At the checked step's graph cut the traced process lets torch_xla compile the step, so that XLA's dump receives
exactly the module torch_xla hands it (buffer donation included), and ends as soon as that module is whole. But
nothing stops XLA:CPU once it has the module: for a small step it then *runs* the step on the placeholders ([Note:
abstract tracing]) within milliseconds, which crashes the process (a segfault, or the pool worker of one process
per chip dying under torch_xla's spawn). That race must not decide the check: the module is whole on disk before
XLA:CPU can run anything (XLA writes it before optimizing it), so whichever side is still alive takes it: the
traced process in its poll, its launcher after a pool worker died, or the check's parent after the traced process
died. "Whole" is read from the text, not guessed from a size that stopped growing: XLA prints the ENTRY
computation last, and its closing brace is the only unindented `}` after the `ENTRY` line.
"""
from __future__ import annotations

import json
import os
from typing import Optional

MARKER = "capturing.json"  # written by the traced process just before the step's compile
RECOMPUTE = "recompute.json"  # what each checkpointed block saved in the compiled step (remat_policy.applied)
TENSORS = "tensors.json"  # the job's tensors by kind, written beside it (capture._tensors_by_kind)
BUFFER_ASSIGNMENT = "buffer_assignment.txt"  # libtpu's buffer assignment of the step, kept for --dump
PROGRAM = "program.txt"
CRASH = "crash.txt"  # faulthandler's report of a traced process that died on a signal
REFUSED = "refused.txt"  # the message of a traced script that ended with sys.exit("...") (a user's mistake)
SUFFIX = ".before_optimizations.txt"


def whole_module(text: str) -> bool:
    """Whether `text` is a complete HLO module as XLA prints it (see the note above)."""
    entry = text.rfind("\nENTRY ")
    return entry >= 0 and text[entry:].rstrip().endswith("\n}")


def step_module(out: str, dump: str) -> Optional[str]:
    """The checked step's module in `dump` once the traced process reached its compile and XLA wrote it whole."""
    marker = os.path.join(out, MARKER)
    if not os.path.exists(marker) or not os.path.isdir(dump):
        return None
    with open(marker) as f:
        before = set(json.load(f).get("dumped_before", ()))
    found = sorted(n for n in os.listdir(dump) if n.endswith(SUFFIX) and n not in before)
    if not found:
        return None
    path = os.path.join(dump, found[-1])
    with open(path) as f:
        return path if whole_module(f.read()) else None


def take_program(out: str, dump: str) -> bool:
    """Make `out/program.txt` (whole or not at all) the step's module if it is whole in `dump`; True if it exists."""
    program = os.path.join(out, PROGRAM)
    if os.path.exists(program):
        return True
    path = step_module(out, dump)
    if path is None:
        return False
    partial = program + ".partial"
    with open(path) as src, open(partial, "w") as dst:
        dst.write(src.read())
    os.replace(partial, program)
    return True


def crash_report(out: str) -> str:
    """The signal and dying thread's stack faulthandler wrote for a traced process ("": none); all in `crash.txt`."""
    path = os.path.join(out, CRASH)
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        sections = [s.strip() for s in f.read().split("\n\n") if s.strip()]
    if not sections:
        return ""
    died = [s for s in sections if s.startswith("Current thread")]
    return "\n".join([sections[0], *died, f"(every thread: {path})"])
