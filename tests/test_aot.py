"""`python -m xla_fsdp.aot`: the report, a user's own loop, collectives users add, bad input.

Real traces and real libtpu compiles (tiny models); nothing is mocked.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from common import aot_cases as ac  # noqa: E402

pytest.importorskip("libtpu", reason="the TPU compiler comes with `pip install -e .[tpu-aot]` (make test installs it)")

OWN_LOOP = os.path.join(ac.ROOT, "tests", "fixtures", "aot_own_loop.py")


def _cli(args, env_extra=None, timeout=600, python_flags=()):
    env = dict(os.environ)
    for name in ("XLA_FSDP_ENGINE", "XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "CPU_NUM_DEVICES", "LIBTPU_INIT_ARGS"):
        env.pop(name, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *python_flags, "-m", "xla_fsdp.aot", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ac.ROOT, env=env)


def test_report_names_memory_and_collectives_and_dumps_the_programs(tmp_path):
    case = ac.BY_NAME["mp-full_shard"]
    cmd = ac.command(case, 4, str(tmp_path / "fsdp.json"), str(tmp_path / "out"))
    # one process per chip (run_clm alone would check the single controller it declares)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = _cli(["--tpu", "v4-8", "--runtime", "multi_process", "--dump", str(tmp_path / "dump"), "--quiet",
                 "--", *cmd], env_extra={"TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # libtpu's own account, read from the log it wrote in the check's own directory, which is gone
    assert "compiles (libtpu" in out and "HBM per chip (libtpu's own account" in out, out
    # where the compile's time went, by libtpu's own log ([Note: where libtpu's compile time goes])
    assert re.search(r"compiles \(libtpu, [\d.]+ s: HLO passes [\d.]+ s, back end [\d.]+ s, code generation", out), out
    assert "of 30.75 GiB usable per chip" in out, out
    assert not [p for p in os.listdir(scratch) if p.startswith("xla_fsdp_aot")], os.listdir(scratch)
    assert "all-gather" in out and "reduce-scatter" in out or "all-reduce" in out, out
    dumped = sorted(os.listdir(tmp_path / "dump"))
    assert "traced_step.hlo.txt" in dumped and "tpu_optimized.hlo.txt" in dumped, dumped
    assert "constrain_layout=true" in (tmp_path / "dump" / "traced_step.hlo.txt").read_text()


def test_own_loop_through_check(tmp_path):
    """A user's loop that hands its step to xla_fsdp.aot.check(), checked as a user runs it.
    - The check's own process (it traces in a child, compiles with libtpu and reports) never
      imports torch ([Note: a package root that loads on first use] in xla_fsdp/__init__.py):
      seen in `python -X importtime`, with glibc's malloc so that the process printing the
      lines is the one that checks.
    - The check walks every live object; torch's FutureWarning about its deprecated `reduce_op`
      must not reach the user's screen (the job's own output is echoed).
    - XLA:CPU runs a small step on the placeholders as soon as it compiled it, which crashes the
      traced process; with the process's poll held back (the check's settings' poll_s) that always
      happens before it looks at the dump. The module is whole there all the same, and the check
      takes it from the dump ([Note: the module is taken from the dump, whoever gets there
      first]); the single controller's turn is in
      test_the_single_controller_is_traced_in_spmd_as_the_launcher_runs_it."""
    proc = _cli(["--tpu", "v5e-8", "--runtime", "multi_process", "--", OWN_LOOP, "--mark"],
                env_extra={"XLA_FSDP_MALLOC": "system", "LD_PRELOAD": "", "XLA_FSDP_AOT": '{"poll_s": 600}'},
                timeout=1200, python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "on v5e-8 (8 chips, 1 host(s))" in out and "compiles (libtpu" in out, out[-3000:]
    assert "  | " in out, out[-3000:]  # the job's output was shown, so a warning in it would be too
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert {"xla_fsdp.aot.cli", "xla_fsdp.aot.report", "xla_fsdp.tpu.pjrt"} <= set(imported), proc.stderr[-3000:]
    assert "torch" not in imported, [m for m in imported if m.startswith(("torch", "xla_fsdp"))]
    assert "FutureWarning" not in out + proc.stderr, [l for l in (out + proc.stderr).splitlines() if "Warning" in l]


def test_collectives_users_add_unpinned_are_named_with_the_fix(tmp_path):
    """xm.all_reduce(pin_layout=False) beside xla_fsdp's pinned collectives: libtpu refuses the
    module; the check names both sides, where the unpinned one came from, and the fix."""
    got = ac.check("v4-8", [OWN_LOOP, "--unpinned_metric"], runtime="multi_process")
    report = got["report"]
    assert got["rc"] == 4 and report is not None and not report["compiles"], got["output"]
    assert "mix of layout constrained and unconstrained" in report["error"]
    cause = report["cause"]
    pinned, unpinned = cause.split("Pinned: ")[1].split("Unpinned: ")
    assert "xla_fsdp/collective_engine/collectives.py" in pinned, cause  # xla_fsdp's side
    assert "xm.all_reduce(..., pin_layout=False) at" in unpinned and "aot_own_loop.py:" in unpinned, cause
    assert "pin_layout_in_collective_ops=False" in cause and "pin_layout=True" in cause, cause


def test_the_single_controller_is_traced_in_spmd_as_the_launcher_runs_it():
    """A loop that never calls xr.use_spmd() itself: xla_spawn turns SPMD on for the single
    controller before the script runs, so the check must too, or it compiles one program per chip
    while reporting the single controller. Its poll held back as in
    test_own_loop_through_check: the single controller's module is taken from the dump too."""
    got = ac.check("v5e-8", [OWN_LOOP, "--mark"], runtime="single_controller", timeout=300,
                   env_extra={"XLA_FSDP_AOT": '{"poll_s": 600}'})
    report = got["report"]
    assert got["rc"] == 0 and report["compiles"] and report["chips"] == 8, got["output"]
    assert report["runtime"] == "single_controller" and report["program"] == "spmd", report
    # [Note: libtpu's compile and the host's malloc]: the check started with the host's faster
    # allocator, when it has one, and says which
    from xla_fsdp.runtime import allocator

    chosen = allocator.choose({k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.MARK)})
    if allocator.started_with():  # the suite started with it (`make test`): the check keeps it
        assert report["allocator"] == allocator.started_with(), report["allocator"]
    elif not os.environ.get("LD_PRELOAD") and not os.environ.get(allocator.ENV):
        assert report["allocator"] == (os.path.basename(chosen) if chosen else "glibc"), report["allocator"]


def test_a_traced_job_that_dies_on_a_signal_says_where():
    """A job whose process dies natively (no Python exception) is reported with the signal and
    the Python line it died on, not an empty log."""
    proc = _cli(["--tpu", "v5e-8", "--runtime", "multi_process", "--quiet", "--",
                 os.path.join(ac.ROOT, "tests", "fixtures", "aot_dies.py")], timeout=300)
    assert proc.returncode != 0
    err = proc.stderr
    assert "before its second training step" in err, err
    assert "Segmentation fault" in err and "aot_dies.py\", line 28 in crash_in_native_code" in err, err


def test_whole_module_reads_the_closing_brace_of_entry():
    """A module cut anywhere before ENTRY's closing brace is not whole."""
    from xla_fsdp.aot.dump import whole_module

    text = ("HloModule m, entry_computation_layout={(f32[])->f32[]}\n\n%add (a: f32[], b: f32[]) -> f32[] {\n"
            "  %a = f32[] parameter(0)\n  ROOT %b = f32[] add(%a, %a)\n}\n\n"
            "ENTRY %main (p: f32[]) -> f32[] {\n  %p = f32[] parameter(0)\n  ROOT %r = f32[] negate(%p)\n}\n\n")
    assert whole_module(text)
    cut_at = [i for i in range(len(text)) if not text[i:].strip()]
    for end in range(len(text)):
        if end < min(cut_at):
            assert not whole_module(text[:end]), repr(text[:end])


@pytest.mark.slow
def test_the_same_loop_without_the_user_collective_compiles():
    """The control for the test above: without the user's collective the loop compiles."""
    got = ac.check("v4-8", [OWN_LOOP], runtime="multi_process")
    assert got["rc"] == 0 and got["report"]["compiles"], got["output"]


def test_unknown_accelerator_type_lists_the_known_ones():
    proc = _cli(["--tpu", "v9-8", "--", ac.RUN_CLM])
    assert proc.returncode == 2
    assert "v9-8" in proc.stderr and "v4-8" in proc.stderr and "v5e-8" in proc.stderr, proc.stderr


def test_missing_script_and_missing_command_are_named():
    proc = _cli(["--tpu", "v4-8", "--", "no/such_script.py"])
    assert proc.returncode == 2 and "no/such_script.py" in proc.stderr, proc.stderr
    proc = _cli(["--tpu", "v4-8"])
    assert proc.returncode == 2 and "put the job's command after --" in proc.stderr, proc.stderr


def test_a_job_that_fails_to_trace_reports_where(tmp_path):
    bad = tmp_path / "bad_model.json"
    bad.write_text('{"model_type": "bert", "vocab_size": 100}')
    proc = _cli(["--tpu", "v4-8", "--quiet", "--", ac.RUN_CLM, "--config_name", str(bad), "--fsdp", "full_shard",
                 "--output_dir", str(tmp_path / "out")])
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "run_clm.py failed before its second training step" in proc.stderr, proc.stderr
    assert "model_type 'bert'" in proc.stderr or "model_type \"bert\"" in proc.stderr or "bert" in proc.stderr


def test_missing_libtpu_names_the_install_command(tmp_path):
    proc = _cli(["--tpu", "v4-8", "--", ac.RUN_CLM], env_extra={"TPU_LIBRARY_PATH": str(tmp_path / "none.so")})
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "pip install" in proc.stderr and "libtpu==0.0.21" in proc.stderr, proc.stderr


def test_check_outside_the_cli_names_the_command():
    import xla_fsdp.aot

    with pytest.raises(RuntimeError, match="python -m xla_fsdp.aot --tpu"):
        xla_fsdp.aot.check(lambda: None)


@pytest.mark.slow  # two traces and two libtpu compiles of an 8.2B-parameter step, about a minute
def test_a_step_that_does_not_fit_is_named_and_checked_again_without_rings(tmp_path):
    """A one-layer GPT-2 with an 8M-token vocabulary (8.2B parameters, AdamW) on v4-8: its
    sharded state alone outgrows a chip's HBM. The check exits 1 with the compiler's numbers and,
    the step being the single controller's default rings, traces and compiles it again with
    XLA_FSDP_RINGS=0 ([Note: rings off for the last GiB]): no rings in that trace, the gathers'
    70% budget, and a step that does not fit either. About a minute here (two traces, two
    compiles)."""
    model = json.load(open(ac.TINY))
    model.update(n_layer=1, n_embd=1024, n_head=8, vocab_size=8_000_000)
    config = tmp_path / "gpt2-wide-vocab.json"
    config.write_text(json.dumps(model))
    case = ac.BY_NAME["sc-full_shard"]
    cmd = ac.command(case, 4, str(tmp_path / "fsdp.json"), str(tmp_path / "out"), model=str(config), batch=1,
                     block=128)
    got = ac.check("v4-8", cmd)
    report = got["report"]
    assert got["rc"] == 1 and report is not None and not report["compiles"], got["output"]
    need = report["does_not_fit"]
    assert need["needed"] > need["usable"] > 0, need
    assert "_shared_memory_limit=50" in report["libtpu_flags"], report["libtpu_flags"]  # the rings' budget
    again = report["without_rings"]
    assert again["traced_ring_ops"] == 0, again  # no rings in the retried step
    assert again["switch"] == {"XLA_FSDP_RINGS": "0"} and "_shared_memory_limit=70" in again["libtpu_flags"], again
    assert again["does_not_fit"]["needed"] > again["does_not_fit"]["usable"], again
    assert 0.5 < again["does_not_fit"]["needed"] / need["needed"] < 2, (again, need)


@pytest.mark.slow  # the default run keeps the 256-chip per-chip case and the multi-host one
def test_single_controller_step_compiles_for_a_slice_of_128_chips(tmp_path):
    """v4-256: 128 chips, one XLA:CPU device each in one traced process. torch's autograd
    numbers devices in 8 bits and fails at 128 devices with an internal assert; the traced
    child runs backward serially there ([Note: 128 chips and up in one traced process]).
    About 20 s here."""
    case = ac.BY_NAME["sc-full_shard"]
    got = ac.check("v4-256", ac.command(case, 128, str(tmp_path / "fsdp.json"), str(tmp_path / "out")))
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"]
    assert (report["chips"], report["hosts"], report["runtime"]) == (128, 32, "single_controller"), report
    assert report["compiles"] and report["fits"], report.get("error")


def test_serial_backward_records_the_same_step():
    """What the check traces at 128+ chips (autograd's multithreading off) is the step it
    traces below that: the same gradients' HLO for a single-controller step with nested,
    checkpointed and bf16 units, and the same again with multithreading back on."""
    env = dict(os.environ, CPU_NUM_DEVICES="4", PJRT_DEVICE="CPU")
    for name in ("XLA_USE_SPMD", "XLA_FSDP_RUNTIME", "XLA_FSDP_ENGINE"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ac.ROOT, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, os.path.join(ac.ROOT, "tests", "single_controller", "serial_backward.py")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == 4
    assert "reduce-scatter" in got["threaded"] or "all-reduce" in got["threaded"], got["threaded"][:2000]
    assert got["serial"] == got["threaded"]
    assert got["threaded_again"] == got["threaded"]


def _trace_both_ways(cmd, devices, tmp_path, monkeypatch):
    """The per-chip job `cmd` traced at `devices` by device threads and by one device standing in
    for rank 0 ([Note: rank 0 alone past 127 chips]); the two programs."""
    from xla_fsdp.aot import trace

    for name in ("XLA_FSDP_ENGINE", "XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "CPU_NUM_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    got = {}
    for alone in ("0", "1"):
        monkeypatch.setenv(trace.environment.AOT, json.dumps({"rank_0_alone": alone == "1"}))
        job = trace.job_from_command(cmd, trace.MULTI_PROCESS, devices)
        assert trace.child_env(job, str(tmp_path / f"env{alone}"), 2)["CPU_NUM_DEVICES"] == (
            "1" if alone == "1" else str(devices))
        os.makedirs(tmp_path / alone)
        got[alone] = trace.run_trace(job, str(tmp_path / alone), timeout=600)
    return got["0"], got["1"]


@pytest.mark.slow  # the default run keeps the 256-chip compile below, which fails without the stand-in
def test_rank_0_alone_traces_the_program_the_device_threads_trace(tmp_path, monkeypatch):
    """Past 127 chips a per-chip job is traced by one device standing in for rank 0 (device
    threads' ordinals wrap there). torch_xla's own FSDP (the blog's anchor job) at 8 chips,
    both ways: the same program, to the character. About 16 s here."""
    threads, alone = _trace_both_ways(
        [os.path.join(ac.ROOT, "launch", "xla_spawn.py"), "--per_chip", os.path.join(ac.ROOT, "bench", "anchor_job.py"),
         "--engine", "fsdpv1", "--config", ac.TINY, "--batch", "2", "--seq", "64", "--grad_ckpt"], 8, tmp_path,
        monkeypatch)
    assert "all-reduce" in threads and "replica_count=8" in threads.split("\n", 1)[0], threads[:500]
    assert alone == threads


@pytest.mark.slow
def test_rank_0_alone_traces_our_per_chip_step_as_the_threads_do(tmp_path, monkeypatch):
    """The same for xla_fsdp's own per-chip engine (run_clm, FULL_SHARD) at 8 chips."""
    cmd = ac.command(ac.BY_NAME["mp-full_shard"], 8, str(tmp_path / "fsdp.json"), str(tmp_path / "out"))
    threads, alone = _trace_both_ways(cmd, 8, tmp_path, monkeypatch)
    assert "all-gather" in threads and alone == threads


def test_per_chip_step_compiles_for_a_slice_of_256_chips(tmp_path):
    """v4-512: one process per chip at 256 chips, rank 0 traced alone on one device standing in
    ([Note: rank 0 alone past 127 chips]); about 20 s here."""
    case = ac.BY_NAME["mp-full_shard"]
    got = ac.check("v4-512", ac.command(case, 256, str(tmp_path / "fsdp.json"), str(tmp_path / "out")),
                   runtime="multi_process", extra=["--dump", str(tmp_path / "dump")])
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"]
    assert (report["chips"], report["hosts"], report["runtime"]) == (256, 64, "multi_process"), report
    assert report["compiles"] and report["fits"], report.get("error")
    header = (tmp_path / "dump" / "traced_step.hlo.txt").read_text().split("\n", 1)[0]
    assert "replica_count=256" in header, header[-200:]


def test_per_chip_jobs_past_127_chips_trace_on_one_device(tmp_path, monkeypatch):
    from xla_fsdp.aot import trace

    monkeypatch.delenv(trace.environment.AOT, raising=False)

    per_chip = trace.Job("train.py", [], trace.MULTI_PROCESS, 256)
    env = trace.child_env(per_chip, str(tmp_path), 2)
    assert (env["CPU_NUM_DEVICES"], json.loads(env["XLA_FSDP_AOT"])["world"]) == ("1", 256)
    env = trace.child_env(trace.Job("train.py", [], trace.MULTI_PROCESS, 127), str(tmp_path), 2)
    assert env["CPU_NUM_DEVICES"] == "127" and "world" not in json.loads(env["XLA_FSDP_AOT"])
    env = trace.child_env(trace.Job("train.py", [], trace.SINGLE_CONTROLLER, 256), str(tmp_path), 2)
    assert env["CPU_NUM_DEVICES"] == "256" and "world" not in json.loads(env["XLA_FSDP_AOT"])


def test_single_controller_step_compiles_for_a_multi_host_slice(tmp_path):
    """v5e-16: 16 chips over 4 hosts, the single controller (run_clm's default on a pod) with
    HYBRID_SHARD (a replica axis: gathers and reduce-scatters, no rings; the compile matrix's
    representative of it, tests/test_tpu_compile_matrix.py); about 30 s here."""
    case = ac.BY_NAME["sc-hybrid"]
    cmd = ac.command(case, 16, str(tmp_path / "fsdp.json"), str(tmp_path / "out"))
    got = ac.check("v5e-16", cmd)
    report = got["report"]
    assert report is not None, got["output"]
    assert report["chips"] == 16 and report["hosts"] == 4 and report["runtime"] == "single_controller"
    assert report["compiles"], report.get("error")
    assert report["program"] == "spmd" and report["fits"] and got["rc"] == 0, (report["program"], report["memory"])
    kinds = report["collectives"]["by_kind"]
    assert "all-gather" in kinds and "reduce-scatter" in kinds, kinds


@pytest.mark.slow
def test_multi_host_slice_compiles_or_is_refused_by_name(tmp_path):
    """v4-32: 16 chips over 4 hosts; the per-chip program at world 16 (under -m slow: a 16-device
    trace and compile; the default run keeps the suite near 15 minutes)."""
    case = ac.BY_NAME["mp-full_shard"]
    cmd = ac.command(case, 16, str(tmp_path / "fsdp.json"), str(tmp_path / "out"))
    got = ac.check("v4-32", cmd, runtime="multi_process")
    report = got["report"]
    assert report is not None, got["output"]
    assert report["chips"] == 16 and report["hosts"] == 4
    assert report["compiles"] or report["error"], report


@pytest.mark.parametrize("name,chips,hosts", [("v4-8", 4, 1), ("v4-32", 16, 4), ("v4-128", 64, 16), ("v5e-8", 8, 1),
                                              ("v5litepod-16", 16, 4), ("v5e-256", 256, 64), ("v5p-8", 4, 1),
                                              ("v6e-8", 8, 1), ("v6e-16", 16, 4)])
def test_accelerator_types_are_the_topologies_libtpu_builds(name, chips, hosts):
    from xla_fsdp.tpu import pjrt, topology

    spec = topology.parse_accelerator_type(name)
    assert (spec.chips, spec.hosts) == (chips, hosts)
    with pjrt.get_compiler().topology(spec.topology_name, spec.options) as topo:
        assert len(topo.devices) == chips and topo.num_processes == hosts
        assert topo.devices[0].kind.startswith("TPU " + spec.chip.generation[:2])


def test_auto_runtime_is_the_one_xla_spawn_picks_on_the_slice(monkeypatch):
    from xla_fsdp.aot import trace

    monkeypatch.delenv("XLA_FSDP_RUNTIME", raising=False)
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    run_clm = ac.RUN_CLM
    own = os.path.join(ac.ROOT, "tests", "fixtures", "aot_own_loop.py")  # declares nothing
    assert trace.runtime_for("auto", False, False, run_clm) == trace.SINGLE_CONTROLLER
    assert trace.runtime_for("auto", False, True, run_clm) == trace.MULTI_PROCESS
    assert trace.runtime_for("auto", True, False, own) == trace.SINGLE_CONTROLLER
    assert trace.runtime_for("auto", False, False, own) == trace.MULTI_PROCESS
    job = trace.job_from_command(["launch/xla_spawn.py", "--per_chip", run_clm, "--x"], "auto", 4)
    assert job.runtime == trace.MULTI_PROCESS and job.args == ["--x"]


def test_a_trainer_script_is_checked_in_the_runtime_it_gets_on_a_tpu(tmp_path):
    """A Hugging Face run_clm-style Trainer script with xla_fsdp's two lines, launched as users do
    (`xla_spawn --num_cores 4 script ...`): on a TPU it runs in the single controller (it imports
    the Trainer integration), so the check traces and compiles that runtime's step and says so."""
    from xla_fsdp.train.data import embedded_documents

    lines = [line.strip() for doc in embedded_documents()[:20] for line in doc.split("\n") if line.strip()]
    (tmp_path / "train.txt").write_text("\n".join(lines[:100]) + "\n")
    (tmp_path / "fsdp.json").write_text(json.dumps({"xla": True, "xla_fsdp_settings": {"compute_dtype": "float32"}}))
    script = os.path.join(ac.ROOT, "tests", "fixtures", "hf_clm_job.py")
    cmd = [os.path.join(ac.ROOT, "launch", "xla_spawn.py"), "--num_cores", "4", script,
           "--output_dir", str(tmp_path / "out"), "--train_file", str(tmp_path / "train.txt"), "--max_steps", "4",
           "--per_device_train_batch_size", "4", "--report_to", "none", "--model_type", "gpt2", "--pad",
           "--fsdp", "--fsdp_config", str(tmp_path / "fsdp.json")]
    got = ac.check("v4-8", cmd, timeout=600)
    report = got["report"]
    assert got["rc"] == 0 and report["compiles"], got["output"]
    assert report["runtime"] == "single_controller" and report["chips"] == 4, report
    assert not (tmp_path / "out" / "checkpoint-2").exists()  # traced, never run


def test_keep_what_fits_is_checked_as_the_slice_runs_it(tmp_path):
    """checkpoint_all_but_last="fit" ([Note: keep what fits] in xla_fsdp/memory/fit.py): the traced job
    finds no device memory figures here, so the check compiles the step with every block
    recomputed, hands its HBM figures to a second trace, and reports that step, the one the
    slice runs: the tiny GPT-2's last block keeps its activations (all but one fit in v4's HBM),
    so backward recomputes less and the step has fewer FLOPs. Two traces, two compiles."""
    import dataclasses

    case = ac.BY_NAME["sc-full_shard"]
    case = dataclasses.replace(case, top={**case.top, "xla_fsdp_grad_ckpt": True},
                               settings={**case.settings, "checkpoint_all_but_last": "fit"})
    cmd = ac.command(case, 4, str(tmp_path / "fsdp.json"), str(tmp_path / "out"))
    got = ac.check("v4-8", cmd)
    report = got["report"]
    assert got["rc"] == 0 and report is not None, got["output"][-3000:]
    fit = report["fit"]
    assert (fit["count"], fit["units"]) == (1, 2), fit
    assert len(fit["saved_per_unit"]) == 2 and min(fit["saved_per_unit"]) > 0, fit
    first = fit["every_unit_recomputed"]
    assert report["projection"]["flops"] < first["projection"]["flops"], (report["projection"], first)
    assert report["memory"]["peak"] > 0 and first["memory"]["peak"] > 0
    split = first["memory"]["breakdown"]  # [Note: keep what fits, over time]: the step's memory before its backward
    assert 0 < split["before_backward"] <= split["curve_peak"] <= split["peak"] + 2 ** 20, split
    assert "last_unit_fits_over_time" not in fit  # a hint only where "fit" keeps none
