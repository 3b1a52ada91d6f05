"""Every TPU figure in README.md says what it is and when it was made.

No TPU ran anything in this project: each TPU step time is PROJECTED by the
step model from libtpu's deviceless compile, each HBM figure is read off a
compiled program, and the only measured TPU steps are other people's (the
blog's, MaxText's). So a reader must be able to tell, next to the number,
which it is and on which day it was made.

The rule, on README.md's prose and tables (code blocks and headings left out):

- a *unit* is one table row, one list item (with its continuation lines) or
  one paragraph;
- a *figure* is a number followed by a time or memory unit (`s`, `ms`,
  `GiB`), a `%`, or `tokens/s`;
- a unit *is about a TPU* when it, or the heading of its section, names one:
  `TPU`, an accelerator type (`v4-8`, `v5e-256`, `v5litepod-16`, ...) or a
  chip generation (`v4`, `v5e`, `v5p`, `v6e`);
- a unit about a TPU that holds a figure must also hold `PROJECTED` (in
  capitals, as the docs write it: "projected" alone is an ordinary verb),
  `compiled` or `measured`, and a date written YYYY-MM-DD.

Pure text: no subprocess, no import of the package.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^\s*```")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
LIST_ITEM = re.compile(r"^\s{0,3}(?:[-*+]|\d+\.)\s")
TABLE_ROW = re.compile(r"^\s*\|")
TABLE_RULE = re.compile(r"^\s*\|[\s:|-]+\|\s*$")
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:%|GiB\b|ms\b|s\b|tokens/s)")
TPU = re.compile(r"\bTPUs?\b|\bv(?:4|5e|5p|6e|5litepod)(?:-\d+)?\b")
KIND = re.compile(r"PROJECTED|\b(?i:compiled|measured)\b")  # PROJECTED in capitals, as the docs write it
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def units(text: str) -> list:
    """(first line number, the unit's text, its section heading) for every table row, list item and
    paragraph of `text` outside code blocks."""
    out, current, start, heading, in_code = [], [], 0, "", False

    def close():
        nonlocal current
        if current:
            out.append((start, "\n".join(current), heading))
        current = []

    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            close()
            in_code = not in_code
            continue
        if in_code:
            continue
        if not line.strip():
            close()
        elif HEADING.match(line):
            close()
            heading = line
        elif TABLE_ROW.match(line):
            close()
            if not TABLE_RULE.match(line):
                out.append((number, line, heading))
        elif LIST_ITEM.match(line):
            close()
            current, start = [line], number
        else:
            if not current:
                start = number
            current.append(line)
    close()
    return out


def unlabelled_figures(text: str) -> list:
    """"line N: ..." for each unit about a TPU that holds a figure without PROJECTED / compiled /
    measured and a date."""
    problems = []
    for number, unit, heading in units(text):
        figures = FIGURE.findall(unit)
        if not figures or not (TPU.search(unit) or TPU.search(heading)):
            continue
        missing = [what for what, pattern in (("PROJECTED, compiled or measured", KIND), ("a date", DATE))
                   if not pattern.search(unit)]
        if missing:
            problems.append(f"line {number}: {', '.join(figures)} without {' and '.join(missing)}: "
                            f"{' '.join(unit.split())[:160]}")
    return problems


def test_every_tpu_figure_in_the_readme_says_what_it_is_and_when():
    problems = unlabelled_figures((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not problems, "README.md: TPU figures without their kind and date:\n" + "\n".join(problems)


@pytest.mark.parametrize("text,fails", [
    ("On a v4-8 the step takes 2.31 s in 27.94 GiB per chip.", True),
    ("On a v4-8 the step takes 2.31 s, PROJECTED from libtpu's compile.", True),           # no date
    ("On a v4-8 the step takes 2.31 s (2026-12-01).", True),                                  # no kind
    ("Projected on a v4-8: 2.31 s (2026-12-01).", True),                                      # PROJECTED in capitals
    ("On a v4-8 the step takes 2.31 s, PROJECTED (2026-12-01).", False),
    ("| 2B v6e-8 | 21.90 GiB | 33.2% |", True),                                             # a table row
    ("| 2B v6e-8 | 21.90 GiB, compiled 2026-11-30 | 33.2% |", False),
    ("- Llama 3 8B: 8,413 tokens/s/chip\n  on v6e-256.", True),                               # a list item
    ("## On a TPU\n\nThe step is 12% shorter with eager attention.", True),                   # the section names it
    ("make train: 108 steps in 23 s on XLA:CPU.", False),                                     # no TPU
    ("```bash\npython -m xla_fsdp.aot --tpu v4-8  # 2.3 s\n```", False),                      # code is not prose
    ("MaxText measured 7,207 tokens/s on v6e-256 (2025-01-01).", False),
])
def test_the_rule_catches_an_unlabelled_figure(text, fails):
    assert bool(unlabelled_figures(text)) == fails, unlabelled_figures(text)
