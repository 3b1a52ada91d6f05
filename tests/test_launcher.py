"""launch/xla_spawn.py, run as users run it: a subprocess on PJRT_DEVICE=CPU.

Fixture scripts under tests/fixtures/ record what a replica sees. The spawn_*
ones run no XLA computation, so each launch takes a fraction of a second (the
spawn-path tests import torch_xla in two processes and take ~15 s). The txla_*
ones are torch_xla-style training scripts (txla_job.py: two steps of a small
FSDP MLP, ~5 s a launch); they hold the world the launcher prints against what
the script sees (tests/test_launcher_world.py).
"""
import json
import signal
import subprocess
import sys
import time

import pytest

from launcher_cases import FIXTURES, LAUNCHER, ROOT, TIMEOUT_S, launch, launcher_env, load_launcher_module


@pytest.fixture
def record(tmp_path):
    return tmp_path / "record.json"


# ---------------------------------------------------------------- valid runs


def test_num_cores_1_runs_in_process_with_argv_untouched(record):
    script = FIXTURES / "spawn_record.py"
    script_args = ["--record", str(record), "--num_cores", "8", "--spmd", "--help", "--", "x y"]
    result = launch("--num_cores", "1", script, *script_args)
    assert result.returncode == 0, result.stderr
    seen = json.loads(record.read_text())
    assert seen["argv"] == [str(script), *script_args]
    assert seen["index"] == 0
    assert seen["CPU_NUM_DEVICES"] == "1"
    assert seen["XLA_FSDP_ENGINE"] is None and seen["XLA_FSDP_RUNTIME"] is None
    assert seen["PJRT_DEVICE"] == "CPU"
    # No spawn on the single-replica path, so the launcher never pulled in XLA.
    assert seen["torch_xla_imported"] is False
    assert "PJRT_DEVICE=CPU (from environment)" in result.stderr


def test_num_cores_4_on_cpu_runs_a_declared_single_controller_script_and_says_what_it_sees(record, tmp_path):
    # the declaration, not the launcher, chooses the single controller on CPU ([Note: no silent
    # world on CPU]); launch/run_clm.py declares it the same way
    script = tmp_path / "declares_single_controller.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(FIXTURES)!r})\n"
                      'XLA_FSDP_TPU_RUNTIME = "single_controller"\nfrom spawn_record import _mp_fn\n')
    result = launch("--num_cores", "4", script, "--record", record, "--num_cores", "2")
    assert result.returncode == 0, result.stderr
    seen = json.loads(record.read_text())
    assert seen["argv"] == [str(script), "--record", str(record), "--num_cores", "2"]
    assert seen["index"] == 0
    assert seen["CPU_NUM_DEVICES"] == "4"
    assert seen["XLA_FSDP_RUNTIME"] == "single_controller" and seen["XLA_FSDP_ENGINE"] is None
    assert seen["XLA_USE_SPMD"] == "1"  # torch_xla's SPMD mode is on before the script runs
    assert 'declares XLA_FSDP_TPU_RUNTIME = "single_controller"' in result.stderr
    reason = [line for line in result.stderr.splitlines() if "single-controller runtime" in line]
    assert len(reason) == 1, result.stderr
    assert "CPU_NUM_DEVICES=4" in reason[0] and "xr.world_size() == 1" in reason[0]


def test_spmd_flag_sets_runtime_and_device_count(record):
    result = launch("--spmd", "--num_cores", "2", FIXTURES / "spawn_record.py",
                    "--record", record)
    assert result.returncode == 0, result.stderr
    seen = json.loads(record.read_text())
    assert (seen["index"], seen["CPU_NUM_DEVICES"], seen["XLA_FSDP_RUNTIME"]) == (0, "2", "single_controller")


def test_default_num_cores_on_cpu_follows_cpu_num_devices(record):
    result = launch("--spmd", FIXTURES / "spawn_record.py", "--record", record,
                    env=launcher_env(CPU_NUM_DEVICES="3"))
    assert result.returncode == 0, result.stderr
    seen = json.loads(record.read_text())
    assert (seen["CPU_NUM_DEVICES"], seen["XLA_FSDP_RUNTIME"]) == ("3", "single_controller")


def test_script_flags_after_double_dash_are_passed_through(record):
    script = FIXTURES / "spawn_record.py"
    result = launch("--num_cores=1", "--", script, "--record", record)
    assert result.returncode == 0, result.stderr
    assert json.loads(record.read_text())["argv"] == [str(script), "--record", str(record)]


def test_script_exit_code_is_the_launcher_exit_code():
    result = launch("--num_cores", "1", FIXTURES / "spawn_exit.py", "7")
    assert result.returncode == 7, result.stderr


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", ["0", "-1", "65", "1000", "2.5", "four"])
def test_invalid_num_cores_is_refused_with_the_valid_values(value, record):
    result = launch(f"--num_cores={value}", FIXTURES / "spawn_record.py", "--record", record)
    assert result.returncode == 2
    assert f"--num_cores '{value}' is not valid on this host (PJRT_DEVICE=CPU)" in result.stderr
    assert "valid values: 1..64" in result.stderr
    assert "Traceback" not in result.stderr
    assert not record.exists()


def test_unsupported_pjrt_device_is_refused(record):
    result = launch("--num_cores", "1", FIXTURES / "spawn_record.py", "--record", record,
                    env=launcher_env(PJRT_DEVICE="ROCM"))
    assert result.returncode == 2
    assert "PJRT_DEVICE=ROCM is not supported" in result.stderr
    assert "PJRT_DEVICE=CPU or PJRT_DEVICE=TPU" in result.stderr


def test_missing_script_path():
    result = launch("--num_cores", "1", "launch/does_not_exist.py", "--flag")
    assert result.returncode == 2
    assert "training script not found: launch/does_not_exist.py" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_script_given():
    result = launch("--num_cores", "1")
    assert result.returncode == 2
    assert "the training script path is missing" in result.stderr


def test_unknown_launcher_flag_before_script():
    result = launch("--num_procs", "4", FIXTURES / "spawn_record.py")
    assert result.returncode == 2
    assert "unrecognized arguments: --num_procs" in result.stderr


def test_script_without_mp_fn():
    result = launch("--num_cores", "1", FIXTURES / "spawn_no_entry.py")
    assert result.returncode == 2
    assert "spawn_no_entry.py defines no function _mp_fn(index)" in result.stderr
    assert "def _mp_fn(index): main()" in result.stderr
    assert "Traceback" not in result.stderr


def test_plain_script_runs_once_as_main_under_the_single_controller():
    # FSDP2 scripts have no _mp_fn: under the single controller they run as `python script.py` would
    result = launch("--spmd", "--num_cores", "1", FIXTURES / "plain_main.py", "--flag", "x")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("plain_main ran as __main__") == 1
    assert "argv=['--flag', 'x'] spmd=True" in result.stdout


def test_mp_fn_that_needs_more_than_the_index_is_refused_by_name():
    # torch_xla's _mp_fn(index, flags) in a script that does not start itself: nothing could
    # give it its flags, so it is refused before it runs, not with a TypeError from inside
    result = launch("--num_cores", "1", FIXTURES / "spawn_needs_flags.py")
    assert result.returncode == 2, result.stderr
    assert "xla_spawn calls _mp_fn(index)" in result.stderr
    assert "_mp_fn(index, flags) (spawn_needs_flags.py:5) cannot be called so" in result.stderr
    assert "missing a required argument: 'flags'" in result.stderr
    assert "xmp.spawn(_mp_fn, args=(...))" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_exits_zero_and_names_the_flags():
    result = launch("--help")
    assert result.returncode == 0
    for text in ("--num_cores", "--spmd", "SCRIPT_ARGS"):
        assert text in result.stdout


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("flags", [["--num_cores", "1"], ["--spmd", "--num_cores", "4"]])
def test_failing_replica_exits_nonzero_with_its_traceback(flags):
    result = launch(*flags, FIXTURES / "spawn_fail.py")
    assert result.returncode == 1
    assert "replica 0 failed" in result.stderr
    assert "Traceback" in result.stderr
    assert "_train_step_that_breaks" in result.stderr
    assert "RuntimeError: fixture replica failure: loss is NaN" in result.stderr


def test_ctrl_c_stops_the_replica_with_exit_130(tmp_path):
    ready = tmp_path / "ready"
    # a shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT:
    # give the launcher the default disposition, as a terminal's foreground job has
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--spmd", "--num_cores", "2",
                             str(FIXTURES / "spawn_sleep.py"), str(ready)],
                            cwd=ROOT, env=launcher_env(), stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "fixture never became ready"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (stderr, ready.read_text())
    assert "interrupted" in stderr


def test_sigterm_reaches_spawned_replicas_and_one_that_does_not_catch_it_ends_with_143(tmp_path):
    """The spawn path (a TPU's one process per chip): SIGTERM to the launcher is passed on to the
    replica, not answered by stopping it; a script without a handler (xla_fsdp.checkpoint.Preemption)
    ends on it, and the launcher says so and exits 128 + SIGTERM."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(FIXTURES / "spawn_pool_driver.py"), str(FIXTURES / "spawn_sleep.py"),
                             str(ready)], cwd=ROOT, env=launcher_env(CPU_NUM_DEVICES="1"), stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM passed on to the 1 replica processes" in stderr, stderr
    assert "ended on the SIGTERM passed on to them without saving" in stderr, stderr


def test_spawn_path_failure_breaks_the_pool_and_reports_the_traceback():
    # The TPU route (xmp.spawn) on CPU: one real replica process. Its failure
    # must come back as exit 1 with its traceback, not as a hang.
    result = subprocess.run(
        [sys.executable, str(FIXTURES / "spawn_pool_driver.py"), str(FIXTURES / "spawn_fail.py")],
        cwd=ROOT, env=launcher_env(CPU_NUM_DEVICES="1"), capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 1, result.stderr
    assert "replica 0 failed" in result.stderr
    assert "RuntimeError: fixture replica failure: loss is NaN" in result.stderr
    assert "The other replicas were stopped" in result.stderr


@pytest.mark.parametrize("flags", [["--num_cores", "1"], ["--spmd", "--num_cores", "4"], ["--per_chip", "--num_cores", "1"]])
def test_a_replicas_exit_message_is_printed_once(flags):
    result = launch(*flags, FIXTURES / "spawn_refuse.py")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("--batch_size 0: must be at least 1") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_spawn_path_prints_a_replicas_exit_message_once_naming_the_replica():
    # the TPU route (xmp.spawn) on CPU's one replica process: what it said comes back through the pool
    result = subprocess.run(
        [sys.executable, str(FIXTURES / "spawn_pool_driver.py"), str(FIXTURES / "spawn_refuse.py")],
        cwd=ROOT, env=launcher_env(CPU_NUM_DEVICES="1"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("--batch_size 0: must be at least 1 (said by replica 0)") == 1, result.stderr
    assert "replica 0 exited with the message above" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- pure parts


def test_detect_device_reads_tpu_device_files_and_env(tmp_path):
    xla_spawn = load_launcher_module()
    assert xla_spawn.detect_device({"PJRT_DEVICE": "tpu"}, str(tmp_path)) == ("TPU", "from environment")
    assert xla_spawn.detect_device({}, str(tmp_path)) == ("CPU", "detected")
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()  # the VFIO control node alone is no TPU
    assert xla_spawn.detect_device({}, str(tmp_path)) == ("CPU", "detected")
    (tmp_path / "vfio" / "0").touch()
    assert xla_spawn.detect_device({}, str(tmp_path)) == ("TPU", "detected")
    (tmp_path / "vfio" / "0").unlink()
    (tmp_path / "accel0").touch()
    assert xla_spawn.detect_device({}, str(tmp_path)) == ("TPU", "detected")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert xla_spawn.detect_device({"TPU_ACCELERATOR_TYPE": "v4-8"}, str(empty)) == ("TPU", "detected")


def test_unset_pjrt_device_is_detected_and_printed(record):
    env = launcher_env()
    del env["PJRT_DEVICE"]
    result = launch("--num_cores", "1", FIXTURES / "spawn_record.py", "--record", record, env=env)
    assert result.returncode == 0, result.stderr
    device = json.loads(record.read_text())["PJRT_DEVICE"]
    assert f"xla_spawn: PJRT_DEVICE={device} (detected)" in result.stderr


def test_tpu_valid_counts_and_plans():
    xla_spawn = load_launcher_module()
    counts = xla_spawn.device_counts("TPU", spmd=False, environ={}, local_devices=lambda: 4)
    assert counts.valid == (1, 4) and counts.default == 4
    with pytest.raises(xla_spawn.UsageError, match=r"--num_cores '2' .*PJRT_DEVICE=TPU\); valid values: 1, 4"):
        xla_spawn.parse_num_cores("2", counts, spmd=False)
    spmd_counts = xla_spawn.device_counts("TPU", spmd=True, environ={}, local_devices=lambda: 4)
    with pytest.raises(xla_spawn.UsageError, match=r"with --spmd\); valid values: 4$"):
        xla_spawn.parse_num_cores("1", spmd_counts, spmd=True)
    with pytest.raises(xla_spawn.UsageError, match="no TPU chip is visible"):
        xla_spawn.device_counts("TPU", spmd=False, environ={}, local_devices=lambda: 0)

    spawn = xla_spawn.make_plan("TPU", 4, spmd=False)
    assert spawn.spawn and "XLA_FSDP_RUNTIME" not in spawn.env and "CPU_NUM_DEVICES" not in spawn.env
    single = xla_spawn.make_plan("TPU", 1, spmd=False)
    assert not single.spawn and single.env["TPU_VISIBLE_CHIPS"] == "0"
    assert single.env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    spmd = xla_spawn.make_plan("TPU", 4, spmd=True)
    assert not spmd.spawn and spmd.env["XLA_FSDP_RUNTIME"] == "single_controller"


def test_tpu_runtime_follows_the_flags_then_the_environment_then_what_the_script_declares(tmp_path):
    xla_spawn = load_launcher_module()
    parse = xla_spawn.build_parser().parse_args
    run_clm = str(ROOT / "launch" / "run_clm.py")
    plain = FIXTURES / "spawn_record.py"  # declares nothing: torch_xla's one process per chip
    spmd, why = xla_spawn.choose_spmd(parse([]), run_clm, "TPU", {})  # one host or a pod alike
    assert spmd and 'XLA_FSDP_TPU_RUNTIME = "single_controller"' in why and "--per_chip" in why
    assert xla_spawn.choose_spmd(parse(["--spmd"]), run_clm, "TPU", {}) == (True, "")
    assert xla_spawn.choose_spmd(parse(["--per_chip"]), run_clm, "TPU", {}) == (False, "")
    assert xla_spawn.choose_spmd(parse([]), run_clm, "TPU", {"XLA_FSDP_RUNTIME": "multi_process"}) == (False, "")
    assert xla_spawn.choose_spmd(parse([]), str(plain), "TPU", {}) == (False, "")
    assert xla_spawn.choose_spmd(parse(["--spmd"]), str(plain), "TPU", {}) == (True, "")
    assert xla_spawn.choose_spmd(parse([]), run_clm, "CPU", {}) == (False, "")  # CPU: make_plan decides
    with pytest.raises(xla_spawn.UsageError, match="contradict"):
        xla_spawn.choose_spmd(parse(["--spmd", "--per_chip"]), run_clm, "TPU", {})
    bad = tmp_path / "bad.py"
    bad.write_text('XLA_FSDP_TPU_RUNTIME = "both"\n')
    with pytest.raises(xla_spawn.UsageError, match="expected 'single_controller' or 'multi_process'"):
        xla_spawn.choose_spmd(parse([]), str(bad), "TPU", {})


@pytest.mark.parametrize("lines", [
    "import xla_fsdp.integrations.transformers\nxla_fsdp.integrations.transformers.enable()\n",
    "from xla_fsdp.integrations import transformers as xt\nxt.enable()\n",
    "def main():\n    from xla_fsdp.integrations.transformers import enable\n    enable()\n",
])
def test_a_script_that_enables_the_trainer_integration_runs_in_the_single_controller(lines, tmp_path):
    """Hugging Face's run_clm.py with our two lines declares nothing else: on a TPU it gets the single
    controller (the runtime whose collectives libtpu overlaps), on CPU at 4 devices it runs there
    instead of being refused as a per-device script, and --per_chip still wins on a TPU."""
    xla_spawn = load_launcher_module()
    parse = xla_spawn.build_parser().parse_args
    script = tmp_path / "run_clm.py"
    script.write_text("import transformers\n" + lines)
    spmd, why = xla_spawn.choose_spmd(parse([]), str(script), "TPU", {})
    assert spmd and "xla_fsdp.integrations.transformers" in why and "--per_chip" in why, why
    assert xla_spawn.choose_spmd(parse(["--per_chip"]), str(script), "TPU", {}) == (False, "")
    single, why = xla_spawn.cpu_replicas(parse([]), str(script), 4, {})
    assert single and "xla_fsdp.integrations.transformers" in why, why
    plain = tmp_path / "plain.py"
    plain.write_text("import transformers\n# xla_fsdp.integrations.transformers in a comment is no import\n")
    assert xla_spawn.choose_spmd(parse([]), str(plain), "TPU", {}) == (False, "")
    with pytest.raises(xla_spawn.UsageError, match="declares no runtime"):
        xla_spawn.cpu_replicas(parse([]), str(plain), 4, {})
