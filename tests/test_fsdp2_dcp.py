"""FSDP2 checkpoints of `xla_fsdp.fsdp` models: state dicts, torch.distributed.checkpoint (DCP)
and resuming the FSDP2 example ([Note: DCP checkpoints of fully_shard models]).

The scenarios run tests/fsdp2/dcp_worker.py (or examples/fsdp2_llama.py) in fresh processes,
CPU_NUM_DEVICES set per process (SPMD mode and the device count are fixed when the XLA
runtime starts). A small Llama trained a step at 4 devices gives every state dict; loads
into a second model must reproduce it exactly (the values are copied, never recomputed),
and every parameter and optimizer state tensor must be sharded like its parameter.

Default run: the 4-device save (every get/set_state_dict option, the full-state-dict
pattern, DCP to a directory, memory://, file:// (and under -m slow, with the emulator, gs://); a checkpoint
of other shapes) and the 1-device load (an FSDP model, an unwrapped CPU model,
dcp_to_torch_save). `-m slow`: the load at 8 devices, and the example's resume parity at 8
and 1 devices after 3 of 6 steps at 4, with a job SIGKILLed in the middle of a save.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gcs_emulator import gcs_emulator  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fsdp2" / "dcp_worker.py"
EXAMPLE = ROOT / "examples" / "fsdp2_llama.py"
EXACT = 0.0  # copies of the same values
LOSS_TOL = 1e-5  # the brief's bound for resumed losses (fp32; different device counts reorder sums)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, extra=None) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), MASTER_PORT=str(_free_port()),
               PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", **(extra or {}))
    env.pop("XLA_USE_SPMD", None)
    return env


def _run(cmd, devices: int, extra_env=None, timeout=1800) -> str:
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, env=_env(devices, extra_env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} at {devices} devices failed:\n{proc.stdout[-6000:]}"
    return proc.stdout


# -- the worker's scenarios --------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("fsdp2_dcp")
    urls = ["memory:///fsdp2_dcp/ckpt", f"file://{root}/url_ckpt"]
    if request.config.getoption("-m") == "slow":  # gs:// against the emulator: tests/test_gcs_emulator.py by default
        try:
            urls.append(request.getfixturevalue("gcs_emulator").fresh("fsdp2-dcp"))
        except pytest.skip.Exception:
            pass  # without the emulator's packages: no gs:// round trip
    _run([WORKER, "save", root / "save.pt", root, *urls], devices=4)
    return root, urls, torch.load(root / "save.pt", weights_only=False)


def _load(root: Path, devices: int) -> dict:
    out = root / f"load{devices}.pt"
    _run([WORKER, "load", out, root], devices=devices)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def loaded_1(saved):
    return _load(saved[0], 1)


def test_state_dicts_have_the_unwrapped_shapes(saved):
    """model and optimizer state dicts of a 4-device model (vocab 67: padded to 68 rows) have
    the plain model's shapes."""
    shapes = saved[2]["shapes"]
    assert shapes["model"] and shapes["optim"]
    for kind in ("model", "optim"):
        wrong = {k: v for k, v in shapes[kind].items() if v[0] != v[1]}
        assert not wrong, f"{kind}: {wrong}"


@pytest.mark.parametrize("option", ["sharded", "sharded_cpu", "full", "full_cpu", "full_bcast"])
def test_get_and_set_state_dict(saved, option):
    """get_state_dict -> set_state_dict into a second model restores model and AdamW state
    exactly, and leaves every parameter and state tensor sharded like its parameter."""
    got = saved[2]["api"][option]
    assert got["model"] <= EXACT and got["optim"] <= EXACT, got
    assert got["shape"] == (67, 32), got
    assert got["device"] == ("cpu" if option.endswith(("_cpu", "_bcast")) else "xla"), got
    assert saved[2]["specs"][option] == []


def test_full_state_dict_save_and_meta_load(saved):
    """{k: v.full_tensor().cpu()} + torch.save; distribute_tensor onto a meta model's
    placements + load_state_dict(assign=True) + to_empty gives the same values, sharded."""
    got = saved[2]["full_pattern"]
    assert got["types"] == ["StateTensor"]
    assert got["diff"] <= EXACT and got["specs"] == []


def test_dcp_save_and_load_to_a_directory_and_urls(saved):
    root, urls, r = saved
    targets = [str(root / "ckpt")] + urls
    assert sorted(r["dcp"]) == sorted(targets)
    print("round trips:", ", ".join(f"{t}: max diff {g['diff']}" for t, g in r["dcp"].items()))
    for target, got in r["dcp"].items():
        assert got["complete"] and got["step"] == 3, target
        assert got["diff"] <= EXACT, (target, got)
        assert got["specs"] == [], target


def test_dcp_load_of_other_shapes_names_the_key_and_both_shapes(saved):
    message = saved[2]["mismatch"]
    assert message is not None, "a checkpoint of vocab 67 loaded into a model of vocab 71"
    assert "model.tok_embeddings.weight" in message
    assert "torch.Size([67, 32])" in message and "torch.Size([71, 32])" in message


def test_dcp_checkpoint_of_4_devices_loads_at_1(saved, loaded_1):
    _check_load(saved[2], loaded_1, 1)


def test_dcp_checkpoint_loads_into_an_unwrapped_cpu_model(loaded_1):
    """dcp.load into a plain nn.Module's state dict, and dcp_to_torch_save's file."""
    assert loaded_1["plain_diff"] <= EXACT
    assert loaded_1["converted_diff"] <= EXACT and loaded_1["converted_optim_diff"] <= EXACT


@pytest.mark.slow
def test_dcp_checkpoint_of_4_devices_loads_at_8(saved):
    _check_load(saved[2], _load(saved[0], 8), 8)


def _check_load(saved: dict, got: dict, devices: int) -> None:
    assert got["devices"] == devices and got["step"] == 3
    assert got["diff"] <= EXACT, got
    assert got["specs"] == [], got["specs"]
    # the step after the load: the same loss as the 4-device model's next step (training goes on alike)
    print(f"loaded at {devices}: next loss {got['next_loss']} vs {saved['next_loss_after']} at 4 devices")
    assert abs(got["next_loss"] - saved["next_loss_after"]) <= LOSS_TOL, (got["next_loss"], saved["next_loss_after"])


# -- the example: resume parity and a save killed midway -------------------------------

EXAMPLE_ARGS = ["--steps", "6", "--save_every", "3", "--seq_len", "16", "--batch_size", "8"]


def _example(devices: int, ckpt: Path, metrics: Path, resume=False, env=None) -> dict:
    args = [EXAMPLE, *EXAMPLE_ARGS, "--checkpoint_dir", ckpt, "--metrics_out", metrics]
    _run(args + (["--resume"] if resume else []), devices, env)
    return json.loads(metrics.read_text())


def _killed_in_save(devices: int, ckpt: Path, step: int) -> str:
    """Run the example with --resume until it holds the save of `step` between its data files
    and its metadata (FSDP2_LLAMA_HOLD_SAVE), then SIGKILL it."""
    cmd = [sys.executable, str(EXAMPLE), *EXAMPLE_ARGS, "--checkpoint_dir", str(ckpt), "--resume"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(devices, {"FSDP2_LLAMA_HOLD_SAVE": str(step)}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith(f"holding the save of step {step}"):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(log[-40:])
    return "".join(log)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2_resume")
    whole = _example(4, tmp / "ckpt4", tmp / "m4.json")
    runs = {"whole": whole}
    for devices in (8, 1):
        ckpt = tmp / f"ckpt{devices}"
        shutil.copytree(tmp / "ckpt4" / "step-3", ckpt / "step-3")
        if devices == 1:  # first a job killed while it saves step 6; the resume must skip that save
            runs["killed_log"] = _killed_in_save(1, ckpt, 6)
            runs["after_kill"] = sorted(os.listdir(ckpt / "step-6"))
        runs[devices] = _example(devices, ckpt, tmp / f"m{devices}.json", resume=True)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 1])
def test_example_resumes_at_other_device_counts(resumed, devices):
    """6 steps at 4 devices with a checkpoint at 3; resumed from it at 8 and at 1 device, the
    next 3 losses equal the uninterrupted run's (model, AdamW state and LR schedule restored)."""
    whole, got = resumed["whole"], resumed[devices]
    assert whole["devices"] == 4 and got["devices"] == devices and got["start_step"] == 3
    assert len(whole["losses"]) == 6 and len(got["losses"]) == 3
    diffs = [abs(a - b) for a, b in zip(got["losses"], whole["losses"][3:])]
    print(f"resumed at {devices}: losses {got['losses']} vs {whole['losses'][3:]}, max diff {max(diffs):.3g}")
    assert max(diffs) <= LOSS_TOL, (got["losses"], whole["losses"][3:])


@pytest.mark.slow
def test_example_killed_during_a_save_resumes_from_the_previous_checkpoint(resumed):
    """SIGKILL between the data files and .metadata of step 6: step-6 has data but no metadata,
    and --resume takes step 3 (then its losses are the uninterrupted run's, test above)."""
    assert resumed["after_kill"] and ".metadata" not in resumed["after_kill"], resumed["after_kill"]
    assert any(name.endswith(".distcp") for name in resumed["after_kill"]), resumed["after_kill"]
    assert resumed[1]["start_step"] == 3
