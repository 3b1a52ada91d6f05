"""The world a script runs at, held against the one launch/xla_spawn.py prints.

torch_xla-style scripts (tests/fixtures/txla_*.py: per-replica data slices by
`xr.world_size()` / `xr.global_ordinal()`, the drop-in FSDP, torch_xla's
checkpoint names) launched on CPU: a script that declares no runtime is
refused at several devices ([Note: no silent world on CPU] in the launcher);
with --spmd it runs as the single controller at the world the launcher prints
(world 1, its batch split over the N devices); a script that starts itself
(xmp.spawn / torch_xla.launch) runs its own `__main__` with its own
arguments; BatchNorm under the single controller is refused naming a path
that works here, and that path is run.
"""
import json
import subprocess
import sys

import pytest

from launcher_cases import FIXTURES, ROOT, launch, launcher_env, load_launcher_module

WORLD = FIXTURES / "txla_world.py"
SELF_START = FIXTURES / "txla_self_start.py"
TRAINING_TIMEOUT_S = 180


def run_pool_driver(*script_args):
    """The launcher's one-process-per-chip route for a self-starting script, on this CPU's one device."""
    return subprocess.run(
        [sys.executable, str(FIXTURES / "spawn_pool_driver.py"), "--self-starting", str(SELF_START),
         *map(str, script_args)],
        cwd=ROOT, env=launcher_env(CPU_NUM_DEVICES="1"), capture_output=True, text=True,
        timeout=TRAINING_TIMEOUT_S)


# ------------------------------------------------ a script that declares nothing


@pytest.mark.parametrize("num_cores", [2, 4])
@pytest.mark.parametrize("script", [WORLD, SELF_START], ids=["mp_fn_index", "self_starting"])
def test_declares_nothing_at_several_cpu_devices_is_refused_by_name(num_cores, script, tmp_path):
    record = tmp_path / "record.json"
    args = [record] if script == WORLD else ["--record", record]
    result = launch("--num_cores", num_cores, script, *args)
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert f"--num_cores {num_cores} on CPU: {script} declares no runtime" in err
    assert f"xr.world_size() == {num_cores}" in err and "CPU cannot run" in err
    # the alternatives, each with the world the script would see there
    assert "--num_cores 1 (one device, world 1)" in err
    assert f"--spmd --num_cores {num_cores}" in err and "xr.world_size() == 1" in err
    assert 'XLA_FSDP_TPU_RUNTIME = "single_controller"' in err
    assert "Traceback" not in err
    assert not record.exists()


@pytest.mark.parametrize("num_cores", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_spmd_runs_a_torch_xla_style_script_at_the_world_it_prints(num_cores, tmp_path):
    result = launch("--spmd", "--num_cores", num_cores, WORLD, tmp_path / "spmd.json", timeout=TRAINING_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    printed = [line for line in result.stderr.splitlines() if "single-controller runtime" in line]
    assert len(printed) == 1, result.stderr
    assert f"one process drives the {num_cores} CPU devices" in printed[0]
    assert "xr.world_size() == 1 and ordinal 0" in printed[0] and "shard metadata world_size 1" in printed[0]
    seen = json.loads((tmp_path / "spmd.json").read_text())
    # the world printed is the world the script saw, in torch_xla's API and in its checkpoint
    assert (seen["world_size"], seen["ordinal"], seen["meta_world_size"]) == (1, 0, 1)
    assert seen["checkpoint"].endswith("_rank-00000000-of-00000001.pth")
    assert seen["rows_per_step"] == 16  # it fed the whole global batch
    # and the devices printed are the ones the engine sharded over, in SPMD mode
    assert seen["is_spmd"] and seen["runtime_devices"] == num_cores and seen["engine_devices"] == num_cores
    # world 1 on N devices trains as world 1 on one device: the same global batch, the same steps
    one = launch("--num_cores", "1", WORLD, tmp_path / "one.json", timeout=TRAINING_TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    alone = json.loads((tmp_path / "one.json").read_text())
    assert (alone["world_size"], alone["engine_devices"], alone["is_spmd"]) == (1, 1, False)
    assert seen["losses"] == pytest.approx(alone["losses"], rel=1e-5)


def test_refusals_and_choices_on_cpu_name_what_asked():
    xla_spawn = load_launcher_module()
    parse = xla_spawn.build_parser().parse_args
    with pytest.raises(xla_spawn.UsageError, match=r"--per_chip asks for one process per device.*--spmd --num_cores 2"):
        xla_spawn.cpu_replicas(parse(["--per_chip"]), str(WORLD), 2, {})
    with pytest.raises(xla_spawn.UsageError, match=r"XLA_FSDP_RUNTIME=multi_process asks"):
        xla_spawn.cpu_replicas(parse([]), str(WORLD), 4, {"XLA_FSDP_RUNTIME": "multi_process"})
    spmd, why = xla_spawn.cpu_replicas(parse([]), str(ROOT / "launch" / "run_clm.py"), 4, {})
    assert spmd and 'declares XLA_FSDP_TPU_RUNTIME = "single_controller"' in why
    # torch_xla's own switch chooses the single controller as --spmd does
    assert xla_spawn.choose_spmd(parse([]), str(WORLD), "CPU", {"XLA_USE_SPMD": "1"})[0]
    with pytest.raises(xla_spawn.UsageError, match="runs only as the single controller"):
        xla_spawn.make_plan("CPU", 2, spmd=False)


# ------------------------------------------------ scripts that start themselves


@pytest.mark.parametrize("entry", ["spawn", "launch"])
def test_self_starting_script_runs_its_own_main_with_its_own_arguments(entry, tmp_path):
    record = tmp_path / "record.json"
    args = ["--record", record, "--entry", entry, "--lr", "0.5", "--steps", "1"]
    result = launch("--num_cores", "1", SELF_START, *args, timeout=TRAINING_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert f"{SELF_START} starts itself" in result.stderr and "world 1" in result.stderr
    seen = json.loads(record.read_text())
    assert seen["argv"] == [str(SELF_START), *map(str, args)]
    # its own argument parser ran (__main__) and its flags reached fn(index, flags)
    assert seen["flags"] == {"record": str(record), "entry": entry, "steps": 1, "lr": 0.5}
    assert (seen["index"], seen["world_size"], seen["ordinal"], seen["in_child_process"]) == (0, 1, 0, False)
    assert len(seen["losses"]) == 1


def test_self_starting_script_under_the_single_controller(tmp_path):
    # torch_xla.launch itself refuses SPMD mode; routed, it runs fn(0, flags) once
    record = tmp_path / "record.json"
    result = launch("--spmd", "--num_cores", "2", SELF_START, "--record", record, "--entry", "launch",
                    timeout=TRAINING_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert "fn(0, *args) once, in this process (the single controller)" in result.stderr
    seen = json.loads(record.read_text())
    assert (seen["world_size"], seen["ordinal"], seen["meta_world_size"]) == (1, 0, 1)
    assert seen["is_spmd"] and seen["engine_devices"] == 2 and seen["flags"]["entry"] == "launch"


def test_self_starting_script_one_process_per_chip_through_torch_xlas_spawn(tmp_path):
    # the TPU route (torch_xla's own spawn, one process per chip) on this CPU's one device:
    # the script's function and its flags must reach a replica process
    record = tmp_path / "record.json"
    result = run_pool_driver("--record", record, "--entry", "launch", "--steps", "1")
    assert result.returncode == 0, result.stderr
    assert "torch_xla.launch: spawning 1 replicas of _mp_fn(index, flags)" in result.stderr
    seen = json.loads(record.read_text())
    assert seen["in_child_process"] and seen["index"] == 0 and seen["flags"]["entry"] == "launch"


@pytest.mark.parametrize("route", ["in_process", pytest.param("per_chip", marks=pytest.mark.slow)])
def test_self_starting_replica_failure_exits_1_with_its_traceback(route, tmp_path):
    args = ["--record", tmp_path / "record.json", "--entry", "fail"]
    result = launch("--num_cores", "1", SELF_START, *args) if route == "in_process" else run_pool_driver(*args)
    assert result.returncode == 1, result.stderr
    assert "replica 0 failed" in result.stderr and "_mp_fn_that_fails" in result.stderr
    assert "RuntimeError: fixture replica 0 failure: loss is NaN" in result.stderr
    if route == "per_chip":
        assert "The other replicas were stopped" in result.stderr


def test_self_starting_function_without_the_index_is_refused_by_name(tmp_path):
    record = tmp_path / "record.json"
    result = launch("--num_cores", "1", SELF_START, "--record", record, "--entry", "no_index")
    assert result.returncode == 2, result.stderr
    err = result.stderr
    # the function, its signature and where, what the launcher passes, and the fix
    assert "xmp.spawn() starts _mp_fn_without_index(flags) (txla_self_start.py:22)" in err
    assert "the replica index, then args=(Namespace(" in err
    assert "_mp_fn_without_index(0, Namespace(" in err and "too many positional arguments" in err
    assert "def _mp_fn_without_index(index, ...)" in err
    assert "Traceback" not in err and "AssertionError" not in err
    assert not record.exists()


def test_entry_calls_are_read_through_import_aliases(tmp_path):
    from xla_fsdp.runtime.self_starting import entry_calls

    def calls(source):
        path = tmp_path / "s.py"
        path.write_text(source)
        return entry_calls(str(path))

    assert calls("import torch_xla.distributed.xla_multiprocessing as xmp\nxmp.spawn(f, args=(1,))\n") == ("xmp.spawn",)
    assert calls("from torch_xla.distributed import xla_multiprocessing as m\n"
                 "if __name__ == '__main__':\n    m.spawn(f)\n") == ("xmp.spawn",)
    assert calls("from torch_xla.distributed.xla_multiprocessing import spawn as go\ngo(f)\n") == ("xmp.spawn",)
    assert calls("import torch_xla.distributed.xla_multiprocessing\n"
                 "torch_xla.distributed.xla_multiprocessing.spawn(f)\n") == ("xmp.spawn",)
    assert calls("import torch_xla as tx\ntx.launch(f)\n") == ("torch_xla.launch",)
    assert calls("from torch_xla import launch\nlaunch(f)\n") == ("torch_xla.launch",)
    # not torch_xla's: torch's own spawn, a local launch(), a mention without a call
    assert calls("import torch.multiprocessing as mp\nmp.spawn(f)\n") == ()
    assert calls("def launch(f): pass\nlaunch(f)\n") == ()
    assert calls("import torch_xla.distributed.xla_multiprocessing as xmp\nentry = xmp.spawn\n") == ()
    assert calls("this is not python(") == ()


def test_nprocs_must_agree_with_num_cores():
    from xla_fsdp.runtime.self_starting import Refused, nprocs_asked

    nprocs_asked("xmp.spawn", None, 4)
    nprocs_asked("xmp.spawn", 1, 1)
    with pytest.raises(Refused, match=r"asks for one replica .* --num_cores 4; run with --num_cores 1"):
        nprocs_asked("xmp.spawn", 1, 4)
    with pytest.raises(Refused, match=r"nprocs=8.*accepts nprocs=1 or None"):
        nprocs_asked("xmp.spawn", 8, 8)


# ------------------------------------------------ buffers updated in place


def test_batch_norm_under_the_single_controller_names_what_works_on_cpu_and_that_works(tmp_path):
    result = launch("--spmd", "--num_cores", "2", WORLD, tmp_path / "bn.json", "batch_norm",
                    timeout=TRAINING_TIMEOUT_S)
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert "the forward updated buffer(s) BatchNorm1d" in err and "num_batches_tracked" in err
    # a path that runs on this machine (not "without --spmd", which still picks it here)
    assert "launch/xla_spawn.py --num_cores 1" in err and "need a TPU (xla_spawn --per_chip)" in err
    assert "track_running_stats=False" in err and "without --spmd" not in err
    assert not (tmp_path / "bn.json").exists()
    # the named path trains the same script, with its running statistics, on this CPU
    one = launch("--num_cores", "1", WORLD, tmp_path / "one.json", "batch_norm", timeout=TRAINING_TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    assert json.loads((tmp_path / "one.json").read_text())["world_size"] == 1


@pytest.mark.slow
def test_batch_norm_without_running_statistics_trains_under_the_single_controller(tmp_path):
    result = launch("--spmd", "--num_cores", "2", WORLD, tmp_path / "bn.json", "untracked_batch_norm",
                    timeout=TRAINING_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    seen = json.loads((tmp_path / "bn.json").read_text())
    assert seen["engine_devices"] == 2 and all(loss == loss for loss in seen["losses"])
