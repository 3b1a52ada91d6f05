"""FSDP2 scripts ported from GPUs with exactly the README's three changes (issue 52, items 1-2).

The fixture tests/fixtures/fsdp2_gpu_port.py is a GPU FSDP2 script in the style of PyTorch's
FSDP2 example (meta init, per-layer fully_shard then the root, mixed precision, explicit prefetch,
DTensor-API and DCP-API checkpoints, no torch_xla.sync() in its loop) whose only changed lines
are the README's. It runs under the launcher as the README says, at 4 and 8 XLA:CPU devices (the
launcher reads its import of xla_fsdp.fsdp as the single controller). The reference is the GPU
script itself: the fixture with its `# was:` lines restored, run by PyTorch alone (its own
`fully_shard` over gloo, on the CPU; tests/fsdp2/torch_reference.py), one rank, as one process
draws the global batch. Both sides start from the same weights (`--load_full`, made on the CPU).
The 4-device run matches it (float32 losses and weights within LOSS_REL / PARAM_REL); the DCP
checkpoint the 4-device run wrote right after its loop (full state dict + dcp.save, seed 003's
pattern; it also writes its DTensor-API full state dict, timed) loads exactly at 8 devices and in
PyTorch's script (DCP's own reader), and both train on in bf16 to the same losses (BF16_LOSS_REL).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PORT = ROOT / "tests" / "fixtures" / "fsdp2_gpu_port.py"
SPAWN = ROOT / "launch" / "xla_spawn.py"
CASES = ROOT / "tests" / "fsdp2" / "api_cases.py"
REFERENCE = ROOT / "tests" / "fsdp2" / "torch_reference.py"
STEPS = 5
# float32 against PyTorch's own FSDP2 on the CPU: measured 1.0e-7 (losses) and 2.7e-7 (weights), the
# sums run in another order on XLA:CPU than in eager PyTorch
LOSS_REL = 2e-6
PARAM_REL = 5e-6
# bf16: XLA:CPU rounds to bfloat16 at other points than eager PyTorch (it fuses elementwise work and
# keeps intermediates in float32); measured 9.3e-5 here
BF16_LOSS_REL = 5e-4
# the saves right after the loop: measured 0.14 s (DCP) and 0.52 s (full state dict) on this machine
SAVE_SECONDS = 5


def _env(extra=None) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("CPU_NUM_DEVICES", "XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    env.update(extra or {})
    return env


def _launch(tmp: Path, name: str, cores: int, *flags: str) -> subprocess.Popen:
    out = tmp / name
    out.mkdir()
    cmd = [sys.executable, str(SPAWN), "--num_cores", str(cores), str(PORT), "--steps", str(STEPS),
           "--metrics_out", str(out / "metrics.json"), *flags]
    log = open(out / "log.txt", "w")
    proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(out))
    proc.out = out
    return proc


def _result(proc: subprocess.Popen) -> dict:
    rc = proc.wait(timeout=900)
    log = (proc.out / "log.txt").read_text()
    assert rc == 0, f"exit {rc}:\n{log[-4000:]}"
    result = json.loads((proc.out / "metrics.json").read_text())
    result["log"] = log
    return result


def _reference(tmp: Path, name: str, *flags: str) -> subprocess.Popen:
    """The GPU script (the `# was:` lines restored) under PyTorch's own FSDP2, one gloo rank on the CPU."""
    out = tmp / name
    cmd = [sys.executable, str(REFERENCE), "port", str(out), "--world", "1", "--", "--steps", str(STEPS),
           "--metrics_out", str(out / "metrics.json"), *flags]
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp))
    proc.out = out
    proc.log = tmp / f"{name}.log"
    return proc


def _reference_result(proc: subprocess.Popen) -> dict:
    rc = proc.wait(timeout=600)
    assert rc == 0, f"PyTorch's reference exited {rc}:\n{proc.log.read_text()[-4000:]}"
    return json.loads((proc.out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("port")
    init = tmp / "init.pt"
    subprocess.run([sys.executable, str(REFERENCE), "port-init", str(init)], check=True, capture_output=True)
    four = _launch(tmp, "four", 4, "--load_full", str(init), "--explicit-prefetching", "--save_full",
                   str(tmp / "full.pt"), "--save_dcp", str(tmp / "dcp"))
    torch_ref = _reference(tmp, "torch", "--load_full", str(init), "--explicit-prefetching")
    out = {"torch": _reference_result(torch_ref), "four": _result(four)}
    bf16 = ("--mixed-precision", "--dcp-api", "--load_dcp", str(tmp / "dcp"))
    torch_bf16 = _reference(tmp, "torch_bf16", *bf16)
    out["eight"] = _result(_launch(tmp, "eight", 8, *bf16))
    out["torch_bf16"] = _reference_result(torch_bf16)
    return out


def _rel(a, b) -> float:
    """|a - b| / |b| for numbers or nested lists (tensor-relative)."""
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_the_readme_lines_are_the_only_changes():
    """Each line of the README's FSDP2 block is in the port, and every line the port marks as
    changed is one of them: the port tests exactly what the README promises."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## FSDP2 scripts", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    promised = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    port = PORT.read_text()
    changed = [line.split("#")[0].strip() for line in port.splitlines() if re.search(r"\S.*  # was: ", line)]
    assert len(promised) == 3 and len(changed) == 3
    for line in changed:
        if line.startswith("from xla_fsdp.fsdp import"):
            names = set(re.split(r"[,\s]+", line.split("import", 1)[1].strip()))
            assert names <= set(re.split(r"[,\s]+", promised[0].split("import", 1)[1].strip())), line
        else:
            assert line in promised, f"{line!r} is not one of the README's lines {promised}"
    import ast

    names = {n.id for n in ast.walk(ast.parse(port)) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(ast.parse(port)) if isinstance(n, ast.Attribute)}
    assert "torch_xla" not in names and "xm" not in names and "XLA_FSDP_TPU_RUNTIME" not in names
    assert not attrs & {"sync", "mark_step", "optimizer_step"}


def test_the_port_runs_under_the_launcher_as_the_single_controller(runs):
    for name, devices in (("four", 4), ("eight", 8)):
        log = runs[name]["log"]
        assert "imports xla_fsdp.fsdp" in log and f"one process drives the {devices} CPU devices" in log, log[-2000:]


def test_four_devices_match_pytorchs_fsdp2_running_the_gpu_script(runs):
    ref, four = runs["torch"], runs["four"]
    assert len(four["losses"]) == len(ref["losses"]) == STEPS
    for i, (a, b) in enumerate(zip(ref["losses"], four["losses"])):
        assert _rel(b, a) <= LOSS_REL, f"step {i}: 4 devices {b}, PyTorch's FSDP2 {a} ({_rel(b, a):.1e} relative)"
    assert set(four["weights"]) == set(ref["weights"]) == {"out.weight", "layers.0.qkv.weight"}
    for name in ref["weights"]:
        assert _rel(four["weights"][name], ref["weights"][name]) <= PARAM_REL, name
    print(f"4 devices against PyTorch's FSDP2: losses within {max(map(_rel, four['losses'], ref['losses'])):.1e}, "
          f"weights within {max(_rel(four['weights'][k], ref['weights'][k]) for k in ref['weights']):.1e}")


def test_the_dcp_save_right_after_a_loop_without_sync_is_quick_and_the_bf16_run_resumes_it_at_8(runs):
    """Seed 003's pattern: get_state_dict(full_state_dict=True) + dcp.save right after a loop without
    a sync, in seconds; dcp.load + set_state_dict at 8 devices gives the same weights exactly, as
    PyTorch's script loading the same checkpoint through DCP's own reader does, and the two train
    on in bf16 to the same losses."""
    eight, four, ref = runs["eight"], runs["four"], runs["torch_bf16"]
    assert four["dcp_seconds"] < SAVE_SECONDS and four["full_seconds"] < SAVE_SECONDS, four
    for name in four["weights"]:
        assert _rel(eight["loaded"][name], four["weights"][name]) == 0, name
        assert _rel(ref["loaded"][name], four["weights"][name]) == 0, name
    assert len(eight["losses"]) == len(ref["losses"]) == STEPS
    for i, (a, b) in enumerate(zip(ref["losses"], eight["losses"])):
        assert _rel(b, a) <= BF16_LOSS_REL, f"bf16 step {i}: 8 devices {b}, PyTorch's FSDP2 {a} ({_rel(b, a):.1e})"
    # Not asserted here: that the run is a bf16 run. At this script's lr and 5 steps, PyTorch's float32
    # resume parts from its bf16 resume by about as much as two bf16 runs part (summed 3.8e-4 against
    # 2.9e-4, measured), so losses cannot tell them apart; test_fsdp2.py's bf16 case does (10 steps).
    assert eight["weights"] != eight["loaded"]
    print(f"bf16 at 8 devices against PyTorch's FSDP2: losses within {max(map(_rel, eight['losses'], ref['losses'])):.1e}")


def test_the_loop_is_cut_once_per_step_and_a_syncing_loop_is_not_cut_again(tmp_path):
    out = tmp_path / "cuts.json"
    proc = subprocess.run([sys.executable, str(CASES), "cuts", str(out)], env=_env({"CPU_NUM_DEVICES": "4"}),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    sync, nosync = r["sync"], r["nosync"]
    # a loop that syncs after each step: exactly its own cuts, from the first step on
    assert [s["cuts"] for s in sync] == list(range(1, len(sync) + 1)), sync
    # without a sync: one cut per step after warm-up, and no compile after the third step
    steady = nosync[3:]
    assert all(b["cuts"] - a["cuts"] == 1 for a, b in zip(steady, steady[1:])), nosync
    assert steady[0]["compiles"] == steady[-1]["compiles"], nosync
    assert all(b["executions"] > a["executions"] for a, b in zip(steady, steady[1:])), nosync


def test_per_chip_is_refused_with_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, str(SPAWN), "--per_chip", "--num_cores", "4", str(PORT)],
                          env=_env(), capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "imports xla_fsdp.fsdp" in proc.stderr and "single controller" in proc.stderr
    assert "Drop --per_chip" in proc.stderr


@pytest.mark.skipif(__import__("importlib").util.find_spec("libtpu") is None,
                    reason="the TPU compiler comes with `pip install -e .[tpu-aot]` (make test installs it)")
@pytest.mark.slow  # FSDP2 compiled for a TPU by default: test_fsdp2.py's HSDP example on v4-16
def test_the_port_compiles_for_v4_8_under_the_check():
    """`python -m xla_fsdp.aot --tpu v4-8 -- launch/xla_spawn.py --num_cores 4 <port>`: the check
    reads the same declaration as the launcher (the single controller), cuts the loop's steps
    itself, and libtpu compiles the step. About 20 s here."""
    from common import aot_cases as ac

    got = ac.check("v4-8", [str(SPAWN), "--num_cores", "4", str(PORT), "--steps", "3", "--mixed-precision",
                            "--explicit-prefetching"], timeout=600)
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"]
    assert report["runtime"] == "single_controller" and report["program"] == "spmd", report
    assert report["compiles"] and report["fits"], report.get("error")
    # the share of asynchronous bytes, in all and per kind (issue 51: a user sees it on their own job)
    c = report["collectives"]
    assert abs(c["async_bytes_fraction"] * c["bytes"] - sum(k["async_bytes"] for k in c["by_kind"].values())) < 1
    assert all(0.0 <= k["async_bytes_fraction"] <= 1.0 for k in c["by_kind"].values()), c
