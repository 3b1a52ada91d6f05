"""The persistent compilation cache (issue 50 item 2; [Note: the persistent compilation cache]).

A job run twice under the launcher with XLA_FSDP_COMPILE_CACHE: the first run compiles and stores
each program in the host's folder; the second finds every one of them by its key, so the programs
hash the same across restarts. On XLA:CPU it cannot load them (torch_xla 2.9's CPU client does not
deserialize executables: counted as PersistentCacheDeserializeFailure, not as a miss) and compiles
again; on a TPU they load (hits). A folder that cannot be written is refused, by the launcher and by
run_clm, naming it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPAWN = ROOT / "launch" / "xla_spawn.py"
JOB = ROOT / "tests" / "fixtures" / "compile_cache_job.py"


def _env(cache) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FSDP_COMPILE_CACHE=str(cache))
    for name in ("CPU_NUM_DEVICES", "XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "XLA_PERSISTENT_CACHE_PATH"):
        env.pop(name, None)
    return env


def _run(cache, tmp) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SPAWN), "--num_cores", "4", str(JOB)], env=_env(cache), cwd=str(tmp),
                          capture_output=True, text=True, timeout=600)


def test_a_restarted_job_finds_every_program_it_compiled(tmp_path):
    cache = tmp_path / "cache"
    first, second = _run(cache, tmp_path), _run(cache, tmp_path)
    for proc in (first, second):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"compiled programs kept in {cache / 'host-0'}" in proc.stderr
    before = json.loads(first.stdout.strip().splitlines()[-1])
    after = json.loads(second.stdout.strip().splitlines()[-1])
    stored = sorted(os.listdir(cache / "host-0"))
    assert before["PersistentCacheMiss"] == len(stored) > 0, (before, stored)
    # the restart: every program's key is found (loaded on a TPU, found but not loadable on XLA:CPU)
    assert after["PersistentCacheMiss"] == 0, after
    assert after["PersistentCacheHit"] + after["PersistentCacheDeserializeFailure"] == len(stored), after
    assert sorted(os.listdir(cache / "host-0")) == stored  # no new key: the same programs


def test_a_cache_folder_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = _run(blocker / "cache", tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"compile cache folder {blocker / 'cache' / 'host-0'} cannot be written" in proc.stderr
    env = _env("off")
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "run_clm.py"), "--config_name",
                           str(ROOT / "configs" / "models" / "gpt2-tiny.json"), "--output_dir", str(tmp_path / "out"),
                           "--compile_cache", str(blocker / "c"), "--max_steps", "1"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "cannot be written" in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_run_clm_keeps_its_programs_under_output_dir_one_folder_per_replica_with_per_chip(tmp_path):
    """README's "compile_cache/ under a local --output_dir": host-<i> under the single controller
    (tests/test_run_clm.py::test_both_engines_through_the_launcher checks a real run's folder),
    rank-<i> for each replica of one process per chip (a TPU's --per_chip; chosen here in a fresh
    process as a replica of 4 would choose it)."""
    code = ("import argparse, sys; from xla_fsdp.train.job import _compile_cache; "
            "args = argparse.Namespace(compile_cache=None, output_dir=sys.argv[1]); "
            "print(_compile_cache(args, False, {'world': 4, 'rank': 2}, print))")
    env = _env("")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "out" / "compile_cache" / "rank-2")
    assert os.path.isdir(tmp_path / "out" / "compile_cache" / "rank-2")


def test_a_replica_spawned_per_chip_keeps_its_programs_in_its_own_folder(tmp_path):
    """XLA_FSDP_COMPILE_CACHE for any script under the launcher: each replica of the spawn path (a TPU's
    one process per chip; here CPU's one replica process through the real process pool) uses rank-<i>."""
    cache = tmp_path / "cache"
    env = dict(_env(cache), CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "spawn_pool_driver.py"),
                           str(ROOT / "tests" / "fixtures" / "spawn_record.py"), "--record", str(tmp_path / "record.json")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.listdir(cache) == ["rank-0"]
