"""The suite's warm interpreters behave as fresh ones ([Note: warm interpreters] in tests/warm).

Every child process of this suite goes through `sys.executable`; these checks
pin what a test relies on: arguments, environment, directory, descriptors,
stdin, exit codes and signals, a killed parent taking its child with it, and
torch_xla imported after the child's environment is set. Skipped when the
suite runs with XLA_FSDP_TEST_WARM=0 (then `sys.executable` is python itself).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("XLA_FSDP_TEST_ZYGOTE"),
                                reason="the suite runs without warm interpreters (XLA_FSDP_TEST_WARM=0)")


def _py(code: str, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, **kw)


def test_arguments_environment_directory_and_stdin_are_the_callers(tmp_path):
    code = ("import os, sys; print(sys.argv[1:], os.environ['WARM_PROBE'], os.getcwd(), sys.stdin.read(), "
            "sys.path[0] == '', 'torch' in sys.modules, 'torch_xla' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code, "a", "b"], input="from stdin", capture_output=True,
                         text=True, cwd=tmp_path, env=dict(os.environ, WARM_PROBE="set"), timeout=120)
    assert got.returncode == 0, got.stderr
    # torch is preloaded; torch_xla is not: it reads the child's environment when the child imports it
    assert got.stdout.strip() == f"['a', 'b'] set {tmp_path} from stdin True True False"


def test_scripts_run_as_main_with_their_folder_first_on_the_path(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script = tmp_path / "job.py"
    script.write_text("import sys, helper\nif __name__ == '__main__':\n    print(__file__, helper.VALUE)\n"
                      "    code = sys.argv[1]\n    sys.exit(int(code) if code.isdigit() else code)\n")
    got = subprocess.run([sys.executable, str(script), "stop"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 1 and got.stdout.strip() == f"{script} 7" and got.stderr.strip() == "stop"
    got = subprocess.run([sys.executable, str(script), "5"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 5


def test_exit_codes_exceptions_and_signals_come_back_as_they_would(tmp_path):
    assert _py("import sys; sys.exit(3)").returncode == 3
    assert _py("import sys; sys.exit(-1)").returncode == 255
    failed = _py("raise ValueError('boom')")
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr
    assert _py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == -signal.SIGKILL
    # an unflushed file of the program's globals is flushed at exit, as python's shutdown does
    out = tmp_path / "unflushed"
    assert _py("import atexit, sys; f = open(sys.argv[1], 'w'); f.write('x' * 10); atexit.register(print, 'bye')",
               str(out)).stdout == "bye\n"
    assert out.read_text() == "x" * 10


def test_descriptors_passed_to_the_child_are_at_their_numbers():
    read, write = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-c", f"import os; os.write({write}, b'through')"],
                              pass_fds=(write,), timeout=120)
        assert proc.returncode == 0
        assert os.read(read, 100) == b"through"
    finally:
        os.close(read)
        os.close(write)


def test_a_killed_or_terminated_parent_takes_the_child_with_it(tmp_path):
    for stop, expected in ((subprocess.Popen.kill, -signal.SIGKILL), (subprocess.Popen.terminate, -signal.SIGTERM)):
        marker = tmp_path / f"pid{expected}"
        proc = subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write("
                                 "str(os.getpid())); time.sleep(300)", str(marker)])
        deadline = time.time() + 60
        while not (marker.exists() and marker.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        child = int(marker.read_text())
        stop(proc)
        assert proc.wait(timeout=30) == expected
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the child {child} outlived its killed parent"


def test_consecutive_children_hash_strings_and_seed_generators_differently():
    """Two fresh interpreters have different string-hash seeds and torch/numpy seeds; the ranks of one
    job must too."""
    got = {_py("import numpy, torch; print(hash('xla_fsdp'))").stdout for _ in range(2)}
    assert len(got) == 2, got
    seeds = [_py("import numpy, torch; print(torch.initial_seed(), numpy.random.rand())").stdout for _ in range(3)]
    assert len(set(seeds)) == 3, seeds


def test_settings_read_at_import_get_a_real_interpreter():
    """OMP_NUM_THREADS is read when torch loads: a child that sets it is not forked from the zygote."""
    got = _py("import torch; print(torch.get_num_threads())", env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert got.stdout.strip() == "1", got.stderr
    # so is the interpreter's own PYTHONHASHSEED: two children with the same seed hash alike
    seeded = {_py("print(hash('xla_fsdp'))", env=dict(os.environ, PYTHONHASHSEED="7")).stdout for _ in range(2)}
    assert len(seeded) == 1, seeded


def test_a_missing_script_is_exit_2_as_python_says(tmp_path):
    got = subprocess.run([sys.executable, str(tmp_path / "absent.py")], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and "can't open file" in got.stderr, got.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between open and read
        return False


def test_modules_run_with_dash_m_as_main_and_warnings_keep_pythons_defaults(tmp_path):
    (tmp_path / "probe_mod.py").write_text("import sys\nif __name__ == '__main__':\n    print(__file__, sys.argv[1:])\n")
    got = subprocess.run([sys.executable, "-m", "probe_mod", "x"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == f"{tmp_path / 'probe_mod.py'} ['x']", got.stderr
    # ResourceWarning is ignored by default; -W and PYTHONWARNINGS still turn warnings on
    assert _py("import warnings; warnings.warn('hidden', ResourceWarning)").stderr == ""
    shown = subprocess.run([sys.executable, "-W", "error::ResourceWarning", "-c",
                            "import warnings; warnings.warn('raised', ResourceWarning)"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 1 and "ResourceWarning: raised" in shown.stderr
