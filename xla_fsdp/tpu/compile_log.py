"""libtpu's own account of a program's HBM, read from the log it writes while compiling.

[Note: the HBM a TPU program needs]
libtpu sizes what a program needs on the chip when it compiles it, and refuses a program that does not fit ("Ran
out of memory in memory space hbm. Used ... of 30.75G hbm"). The figure it sets against the chip is in its INFO
log, written to `TPU_LOG_DIR` (default /tmp/tpu_logs) as the compile finishes:

    Total hbm usage >= 18.59G:
        reserved          1.25G        (the runtime's own, outside the usable 30.75G of a v4 chip)
        program          11.20G        (the program's temporaries + its code overlays)
        arguments         6.14G
    Output size 6.14G; shares 6.14G with arguments.
    XLA::TPU program HBM usage: 11.20G / 30.75G
    Program hbm requirement 11.20G:
        HLO temp         11.12G (... Unpadded (6.57G) ..., 40.9% fragmentation (4.55G))
        overlays         76.03M

So a chip needs program + arguments + the outputs that do not reuse an argument, out of the usable HBM libtpu
prints. PJRT's compiled-memory statistics count the heap's fragmentation twice: their temporaries are libtpu's
"HLO temp" (which already holds it) plus the fragmentation again. A While loop fragments the heap most, so a
scanned program looked up to 4.5 GiB larger than it is and one libtpu compiled could be reported as not fitting.
The check reports libtpu's figure with PJRT's beside it; without the log (a libtpu that writes none, `TPU_LOG_DIR`
unwritable) it falls back to PJRT's and says so. Sizes in the log carry three or four significant digits
("11.20G" is GiB).

libtpu logs as glog does: INFO lines wait in a buffer until a later line finds 30 s gone since the last flush, so
a long compile's last lines (the HBM block, the last stages) may not be in the file when the compile returns (the
check then reported PJRT's "does not fit" for a step libtpu fitted). `get_compiler` loads libtpu with
`--logbuflevel=-1` (every line written as it is logged), in LIBTPU_INIT_ARGS for the load only, unless the user
set a `logbuflevel` there; on a TPU xla_fsdp's own LIBTPU_INIT_ARGS carry it too (libtpu_flags.at_start).

[Note: where libtpu's compile time goes]
The same log times the compile's stages, each as it ends (the scanned 2B GPT-2 for v4-8):

    HLO_PASSES stage duration: 6.21289378425s
    BACKEND_PASSES stage duration: 1m7.34833860575s
    CODE_GENERATION stage duration: 4.40564704325s
    END_TO_END stage duration: 1m18.807875987s

The HLO passes are the whole-program work (partitioning, fusion, layout, scheduling); the back end lowers each
kernel to the chip's instructions, a few at a time, one per compile thread, and is where a step with many or large
kernels spends its compile; code generation packs the program. The check prints them beside its compile time, so a
user whose compile is slow sees which part grows.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import time
from dataclasses import dataclass
from typing import Dict, Optional

from xla_fsdp.runtime import environment

DEFAULT_DIR = "/tmp/tpu_logs"
_UNITS = {"": 1, "B": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_SIZE = r"([\d.]+)([BKMGT])"
_USAGE = re.compile(r"XLA::TPU program HBM usage: " + _SIZE + " / " + _SIZE)
_TOTAL = re.compile(r"Total hbm usage >= " + _SIZE + r":\n(?P<rows>(?:.*\]\s+\w+\s+\S+\s*\n)+)")
_ROW = re.compile(r"\]\s+(reserved|program|arguments)\s+" + _SIZE)
_OUTPUT = re.compile(r"Output size " + _SIZE + "; shares " + _SIZE + " with arguments")
_REQUIREMENT = re.compile(r"Program hbm requirement " + _SIZE + r":\n(?P<rows>(?:.*\]\s{2,}\w.*\n)+)")
_TEMP = re.compile(r"\]\s+HLO temp\s+" + _SIZE + r" .*fragmentation \(" + _SIZE + r"\)")


def size_bytes(value: str, unit: str) -> int:
    """libtpu's printed size ("11.20", "G") in bytes; its "G" is GiB."""
    return int(round(float(value) * _UNITS[unit]))


@dataclass(frozen=True)
class ProgramHbm:
    """What libtpu says one compiled program needs on each chip, in bytes."""
    program: int  # temporaries (with their fragmentation) + code overlays
    arguments: int
    outputs: int
    shared: int  # output bytes that reuse argument buffers
    usable: int  # the chip's HBM libtpu lets programs use
    reserved: int
    temporaries: int  # libtpu's "HLO temp"
    fragmentation: int

    @property
    def total(self) -> int:
        """program + arguments + the outputs that do not reuse an argument."""
        return self.program + self.arguments + max(0, self.outputs - self.shared)


@contextlib.contextmanager
def unbuffered_log():
    """LIBTPU_INIT_ARGS with `--logbuflevel=-1` while libtpu loads (it reads them then), restored after."""
    from xla_fsdp.tpu.libtpu_flags import UNBUFFERED_LOG

    name = environment.LIBTPU_INIT_ARGS
    before = environment.raw(name)
    if "logbuflevel" not in (before or ""):
        os.environ[name] = " ".join(a for a in ((before or "").strip(), UNBUFFERED_LOG) if a)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


_LOADED_WITH: Optional[str] = None  # TPU_LOG_DIR when libtpu loaded in this process (it reads it once)


def libtpu_loading() -> None:
    """Called as libtpu loads: its log directory is fixed from then on."""
    global _LOADED_WITH
    _LOADED_WITH = environment.raw(environment.TPU_LOG_DIR) or DEFAULT_DIR


def log_file() -> Optional[str]:
    """This process's libtpu INFO log (the newest), if libtpu writes one."""
    where = _LOADED_WITH or environment.raw(environment.TPU_LOG_DIR) or DEFAULT_DIR
    found = glob.glob(os.path.join(where, f"*.log.INFO.*.{os.getpid()}"))
    return max(found, key=os.path.getmtime) if found else None


def mark() -> tuple:
    """Where this process's log ends now: read what a compile adds with `since(mark)`."""
    path = log_file()
    return (path, os.path.getsize(path) if path else 0)


def since(where: tuple) -> str:
    """The log text written after `mark()` returned `where` ("" without a log)."""
    path, offset = where
    now = log_file()
    if now is None:
        return ""
    if now != path:  # a new file (libtpu rolled it, or none existed before)
        offset = 0
    with open(now, errors="replace") as f:
        f.seek(offset)
        return f.read()


def compile_since(where: tuple, wait_s: float = 2.0) -> str:
    """`since(where)` for a compile that just returned, read again for up to `wait_s` s while its stages lack
    END_TO_END: even unbuffered, libtpu's lines reach the file some time after they are logged."""
    text = since(where)
    deadline = time.monotonic() + wait_s
    while (stages := stage_seconds(text)) and "end_to_end" not in stages and time.monotonic() < deadline:
        time.sleep(0.02)
        text = since(where)
    return text


_STAGE = re.compile(r"\b(HLO_PASSES|BACKEND_PASSES|CODE_GENERATION|END_TO_END) stage duration: ([0-9hmsu.]+)")
STAGES = {"HLO_PASSES": "hlo_passes", "BACKEND_PASSES": "back_end", "CODE_GENERATION": "code_generation",
          "END_TO_END": "end_to_end"}  # libtpu's names -> ours
_PART = re.compile(r"([0-9.]+)(h|ms|us|m|s)")
_PART_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def duration_seconds(value: str) -> float:
    """libtpu's printed duration ("1m7.348s", "862.7ms", "3.62s") in seconds."""
    parts = _PART.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"not a libtpu duration: {value!r}")
    return sum(float(n) * _PART_SECONDS[u] for n, u in parts)


def stage_seconds(text: str) -> Dict[str, float]:
    """The compile's stages by our names, seconds each, from the last compile in `text` (its log); {} without."""
    found: Dict[str, float] = {}
    for m in _STAGE.finditer(text):
        found[STAGES[m.group(1)]] = duration_seconds(m.group(2))
    return found


def program_hbm(text: str) -> Optional[ProgramHbm]:
    """libtpu's HBM account of the last program compiled in `text` (its log), or None."""
    totals = list(_TOTAL.finditer(text))
    usage = list(_USAGE.finditer(text))
    outputs = list(_OUTPUT.finditer(text))
    if not (totals and usage and outputs):
        return None
    rows = {m.group(1): size_bytes(m.group(2), m.group(3)) for m in _ROW.finditer(totals[-1].group("rows"))}
    if "program" not in rows or "arguments" not in rows:
        return None
    # the HBM block comes first after "Total hbm usage" (host and cmem follow): its Output line
    out = next((m for m in outputs if m.start() > totals[-1].start()), outputs[-1])
    u = usage[-1]
    needs = [m for m in _REQUIREMENT.finditer(text) if m.start() > totals[-1].start()]
    temp = _TEMP.search(needs[0].group("rows")) if needs else None  # none when the program has no temporaries
    return ProgramHbm(program=rows["program"], arguments=rows["arguments"],
                      outputs=size_bytes(out.group(1), out.group(2)), shared=size_bytes(out.group(3), out.group(4)),
                      usable=size_bytes(u.group(3), u.group(4)), reserved=rows.get("reserved", 0),
                      temporaries=size_bytes(temp.group(1), temp.group(2)) if temp else 0,
                      fragmentation=size_bytes(temp.group(3), temp.group(4)) if temp else 0)


def largest_program_hbm(text: str) -> Optional[ProgramHbm]:
    """libtpu's HBM account of the program needing the most HBM of all those compiled in `text`."""
    starts = [m.start() for m in _TOTAL.finditer(text)] + [len(text)]
    found = [h for end in starts[1:] if (h := program_hbm(text[:end])) is not None]
    return max(found, key=lambda h: h.total) if found else None
