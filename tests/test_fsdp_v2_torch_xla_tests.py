"""torch_xla 2.9's own FSDPv2 unit tests, in their style, pass with xla_fsdp's class (issue 82,
item 7): tests/fixtures/txla_fsdp_v2_style.py at 4 XLA:CPU devices, with torch_xla's nesting
(children first, then the root) and `extra_data_axis` trained against plain PyTorch. And a
script that touched the device before `xr.use_spmd()`, which would die in its first sync, is
stopped by every door with the call to move."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
# every test of torch_xla's test/spmd/test_fsdp_v2.py that runs on CPU, plus the two parity runs
EXPECTED = {"test_fsdp_v2_basic", "test_fsdp_v2_output_correctness", "test_fsdp_v2_nested_trains_as_pytorch",
            "test_fsdp_v2_auto_wrap_basic", "test_fsdp_v2_auto_wrap_callable", "test_fsdp_v2_global_mesh",
            "test_fsdp_v2_global_mesh_error", "test_fsdp_v2_cpu_model", "test_fsdp_v2_multi_slice_trains_as_pytorch",
            "test_fsdp_v2_multi_slice_error"}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_USE_SPMD", None)  # the scripts turn SPMD on themselves, as torch_xla's tests do
    return subprocess.run([sys.executable, str(FIXTURES / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)


def test_torch_xlas_fsdp_v2_tests_pass_with_ours():
    proc = _run("txla_fsdp_v2_style.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    ran = set(re.findall(r"^(test_\w+) \(", out, flags=re.M))
    assert ran == EXPECTED, ran ^ EXPECTED
    assert re.search(rf"^Ran {len(EXPECTED)} tests", out, flags=re.M) and out.rstrip().endswith("OK"), out[-2000:]


def test_use_spmd_after_the_device_is_refused_by_every_door():
    proc = _run("txla_late_spmd.py", "fsdpv2", "gspmd", "collectives")
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0]
                 in ("fsdpv2", "gspmd", "collectives"))
    assert proc.returncode == 0 and set(lines) == {"fsdpv2", "gspmd", "collectives"}, proc.stdout + proc.stderr[-3000:]
    for door, line in lines.items():
        assert line.startswith("RuntimeError (unchanged): "), (door, line)
        assert "use_spmd() was called after this process had used the XLA device (CPU:0" in line, (door, line)
        assert "Move the xr.use_spmd() call to the top of the script" in line, (door, line)
