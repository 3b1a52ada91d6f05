"""One training step traced (never run) on XLA:CPU device threads, its HLO read back, and its
instructions picked out by opcode (tests/test_hlo.py, tests/test_overlap.py, bench/comm_volume.py,
bench/overlap.py). The trace runs `common.hlo_trace_worker` in a child process."""
import json
import os
import re
import subprocess
import sys
from typing import Dict, List

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


def trace(configs: List[dict], out_dir: str, world: int = 8, timeout: int = 600) -> None:
    """Each of `configs` ({"name", "model", "engine", "kwargs"}) traced at `world` devices; every
    rank writes OUT_DIR/<name>.rank<r>.hlo (`read`)."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(world),
               PYTHONPATH=os.pathsep.join(p for p in (BENCH, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, "-m", "common.hlo_trace_worker", out_dir, json.dumps(configs)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"trace worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def read(out_dir: str, name: str, world: int = 8) -> Dict[int, str]:
    return {r: open(os.path.join(out_dir, f"{name}.rank{r}.hlo")).read() for r in range(world)}


def ops(hlo: str, op: str) -> List[str]:
    """Instruction lines whose opcode is `op`."""
    pat = re.compile(rf"^\s*(ROOT\s+)?%\S+\s*=.*?\s{re.escape(op)}\(")
    return [line for line in hlo.splitlines() if pat.search(line)]


def normalized(hlo: str) -> str:
    """HLO text without instruction numbering and module ids (which differ between traces)."""
    hlo = re.sub(r"HloModule \S+", "HloModule M", hlo)
    hlo = re.sub(r"\.\d+\b", "", hlo)
    return hlo


def result_elements(line: str) -> int:
    """Number of elements in an instruction's (array) result, e.g. f32[8,365]{1,0} -> 2920."""
    m = re.search(r"=\s*\(?\w+\[([\d,]*)\]", line)
    dims = [int(d) for d in m.group(1).split(",") if d] if m else []
    n = 1
    for d in dims:
        n *= d
    return n


def result_bytes(line: str) -> int:
    m = re.search(r"=\s*\(?(\w+)\[", line)
    width = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "s64": 8, "f64": 8}.get(m.group(1), 4) if m else 4
    return result_elements(line) * width
