"""[Note: libtpu's compile and the host's malloc] (xla_fsdp/runtime/allocator.py): which malloc a
compiling process starts with, and that the restart really loads it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xla_fsdp.runtime import allocator

# a library of glibc's own that Python never loads: mapped in the new process only if preloaded
PROBE_LIB = next((p for p in ("/lib/x86_64-linux-gnu/libBrokenLocale.so.1", "/lib/aarch64-linux-gnu/libBrokenLocale.so.1",
                              "/lib64/libBrokenLocale.so.1") if os.path.exists(p)), None)


def test_system_keeps_glibc_and_a_users_preload_is_theirs():
    assert allocator.choose({allocator.ENV: "system"}) is None
    assert allocator.choose({"LD_PRELOAD": "/opt/my/libfoo.so"}) is None
    assert allocator.preload_environment({allocator.ENV: "system"}) == {}
    assert allocator.in_use({}) == "glibc"
    assert allocator.in_use({"LD_PRELOAD": "/opt/my/libfoo.so"}) == "libfoo.so"


def test_a_named_library_is_taken_and_a_missing_one_refused(tmp_path):
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    env = {allocator.ENV: str(lib), "LD_PRELOAD": "/opt/other.so"}
    assert allocator.preload_environment(env) == {"LD_PRELOAD": f"/opt/other.so {lib}",
                                                  allocator.MARK: json.dumps({"malloc": "libmymalloc.so"})}
    with pytest.raises(allocator.AllocatorError, match="no such file.*'system'"):
        allocator.choose({allocator.ENV: str(tmp_path / "missing.so")})
    # once chosen (the mark set by the restart), never again: no exec loop
    assert allocator.choose({allocator.ENV: str(lib), allocator.MARK: json.dumps({"malloc": "libmymalloc.so"})}) is None


def test_auto_takes_the_first_library_this_host_has():
    found = [allocator.find_library(n) for n in allocator.CANDIDATES]
    chosen = allocator.choose({})
    assert chosen == next((p for p in found if p), None)
    if chosen:
        assert os.path.basename(chosen).startswith(("libtcmalloc", "libjemalloc"))


@pytest.mark.skipif(PROBE_LIB is None, reason="no libBrokenLocale.so.1 where glibc's hosts keep it")
def test_restart_loads_the_library_into_the_new_process(tmp_path):
    """The restarted process has the library mapped and the mark set; run with a library every
    glibc host has (harmless to preload) so that the test needs no malloc package."""
    probe = ("import os, sys\nfrom xla_fsdp.runtime import allocator\n"
             "allocator.restart_with([sys.executable, *sys.argv])\n"
             "maps = open('/proc/self/maps').read()\n"
             "print(allocator.started_with() or None, os.path.realpath(sys.argv[1]) in maps)\n")
    script = tmp_path / "probe.py"
    script.write_text(probe)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.MARK)}
    env[allocator.ENV] = PROBE_LIB
    out = subprocess.run([sys.executable, str(script), PROBE_LIB], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["libBrokenLocale.so.1", "True"]
    env[allocator.ENV] = "system"
    out = subprocess.run([sys.executable, str(script), PROBE_LIB], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "False"]


def test_the_checks_report_says_how_to_get_the_faster_compile():
    from xla_fsdp.aot import report

    assert "apt install libjemalloc2" in report._allocator("glibc")
    assert report._allocator("libjemalloc.so.2") == "; libjemalloc.so.2" and report._allocator(None) == ""


@pytest.mark.skipif(PROBE_LIB is None, reason="no libBrokenLocale.so.1 where glibc's hosts keep it")
def test_the_launcher_starts_a_tpu_job_again_with_the_allocator_and_a_cpu_job_as_it_is(tmp_path):
    """On a TPU the job's first step is a libtpu compile: `launch/xla_spawn.py` starts again with
    the allocator (its log line comes from the restarted process, which alone has the mark). This
    host has no TPU, so the restarted launcher then stops where it reads the chips, with a usage
    error (exit 2); on CPU it never restarts."""
    script = tmp_path / "train.py"
    script.write_text("def _mp_fn(index):\n    print('ran', index)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.MARK)}
    env.update({allocator.ENV: PROBE_LIB, "PJRT_DEVICE": "TPU", "TPU_SKIP_MDS_QUERY": "1"})
    spawn = os.path.join(os.path.dirname(__file__), "..", "launch", "xla_spawn.py")
    out = subprocess.run([sys.executable, spawn, "--num_cores", "1", str(script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert "allocator: libBrokenLocale.so.1 preloaded" in out.stderr, out.stderr
    assert out.returncode == 2 and "TPU could not be read" in out.stderr, out.stderr  # a usage error, no traceback
    assert "Traceback" not in out.stderr
    env["PJRT_DEVICE"] = "CPU"
    out = subprocess.run([sys.executable, spawn, "--num_cores", "1", str(script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ran 0" in out.stdout, out.stderr
    assert "allocator:" not in out.stderr
