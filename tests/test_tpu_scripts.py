"""tpu_scripts/*.sh: the gcloud commands each prints under --dry-run, option errors,
and a syntax check (bash -n, plus shellcheck when it is installed).

The dry-run lines are parsed back with shlex, so these tests also prove the
printed commands are valid shell that can be pasted as they are.
"""
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "tpu_scripts"
ENTRY_SCRIPTS = ["create.sh", "install.sh", "run.sh", "copy_results.sh", "delete.sh"]
ALL_SCRIPTS = sorted(p.name for p in SCRIPTS_DIR.glob("*.sh"))
LOCATION = ["--name", "my-tpu", "--zone", "us-central2-b"]
TPU_VM = ["gcloud", "compute", "tpus", "tpu-vm"]


@pytest.fixture(scope="module")
def guarded_path(tmp_path_factory):
    """PATH whose first `gcloud` fails: a test that forgot --dry-run must not
    reach a real cloud account (this machine may have gcloud installed)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    stub = bin_dir / "gcloud"
    stub.write_text("#!/bin/sh\necho 'test ran gcloud for real' >&2\nexit 99\n")
    stub.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.fixture(autouse=True)
def _no_real_gcloud(guarded_path, monkeypatch):
    monkeypatch.setenv("PATH", guarded_path)


def script(name, *args):
    return subprocess.run(["bash", str(SCRIPTS_DIR / name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def dry_run(name, *args):
    """The commands a script would run, each split into words.

    --dry-run goes first: after `--` it would be a training flag for run.sh.
    """
    result = script(name, "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines()]


def flag_value(words, flag):
    values = [w.split("=", 1)[1] for w in words if w.startswith(flag + "=")]
    assert len(values) == 1, (flag, words)
    return values[0]


def remote_commands(words):
    """The worker-side commands inside --command=..., split at '&&'."""
    command = shlex.split(flag_value(words, "--command"))
    steps, step = [], []
    for word in command:
        if word == "&&":
            steps.append(step)
            step = []
        else:
            step.append(word)
    return steps + [step]


def test_every_entry_script_exists_and_is_executable():
    for name in ENTRY_SCRIPTS:
        path = SCRIPTS_DIR / name
        assert path.is_file(), name
        assert path.stat().st_mode & 0o111, f"{name} is not executable"


def test_create_prints_tpu_vm_create_with_accelerator_and_runtime():
    (words,) = dry_run("create.sh", *LOCATION, "--accelerator-type", "v4-32",
                       "--runtime-version", "tpu-ubuntu2204-base", "--project", "proj-1")
    assert words[:6] == TPU_VM + ["create", "my-tpu"]
    assert flag_value(words, "--zone") == "us-central2-b"
    assert flag_value(words, "--accelerator-type") == "v4-32"
    assert flag_value(words, "--version") == "tpu-ubuntu2204-base"
    assert flag_value(words, "--project") == "proj-1"


def test_create_defaults_to_v4_8_and_omits_project():
    (words,) = dry_run("create.sh", *LOCATION)
    assert flag_value(words, "--accelerator-type") == "v4-8"
    assert not any(w.startswith("--project") for w in words)


def test_install_copies_head_and_installs_pins_on_all_workers():
    archive, scp, ssh = dry_run("install.sh", *LOCATION)
    assert archive[:4] == ["git", "-C", str(ROOT), "archive"] and archive[-1] == "HEAD"
    tarball = flag_value(archive, "--output")
    assert scp[:5] == TPU_VM + ["scp"] and tarball in scp and "--worker=all" in scp
    assert ssh[:6] == TPU_VM + ["ssh", "my-tpu"] and "--worker=all" in ssh
    steps = remote_commands(ssh)
    assert ["python3", "-m", "venv", ".venv"] in steps
    pinned = "torch_xla==" + next(line.split("==")[1] for line in
                                  (ROOT / "requirements.txt").read_text().splitlines()
                                  if line.startswith("torch_xla=="))
    assert [".venv/bin/pip", "install", "-r", "requirements.txt",
            pinned.replace("torch_xla", "torch_xla[tpu]")] in steps
    assert [".venv/bin/pip", "install", "--no-deps", "-e", "."] in steps
    # Code is unpacked before anything is installed from it.
    assert steps.index(["cd", "xla_fsdp"]) < steps.index(["python3", "-m", "venv", ".venv"])


def test_install_with_repo_url_clones_instead_of_copying():
    (ssh,) = dry_run("install.sh", *LOCATION, "--repo-url", "https://example.com/x.git",
                     "--ref", "v0.1", "--remote-dir", "work dir")
    assert "--worker=all" in ssh
    command = flag_value(ssh, "--command")
    assert "git clone https://example.com/x.git 'work dir'" in command
    assert ["git", "-C", "work dir", "checkout", "v0.1"] in remote_commands(ssh)


def test_run_launches_the_recipe_job_on_all_workers():
    (words,) = dry_run("run.sh", *LOCATION)
    assert words[:6] == TPU_VM + ["ssh", "my-tpu"]
    assert "--worker=all" in words
    assert flag_value(words, "--zone") == "us-central2-b"
    train = remote_commands(words)[-1]
    assert train[:4] == ["PJRT_DEVICE=TPU", "python3", "-u", "launch/xla_spawn.py"]
    assert train[4:7] == ["--num_cores", "4", "launch/run_clm.py"]
    args = train[7:]
    expected = {"--config_name": "configs/models/gpt2-2b.json", "--fsdp": "full_shard",
                "--fsdp_config": "configs/fsdp/gpt2_xla_fsdp.json",
                "--per_device_train_batch_size": "32", "--block_size": "1024",
                "--optim": "adafactor", "--num_train_epochs": "1", "--output_dir": "/tmp/test-clm"}
    assert dict(zip(args[::2], args[1::2])) == expected
    # The job's files must be in the repository the workers received.
    for key in ("--config_name", "--fsdp_config"):
        assert (ROOT / expected[key]).is_file(), expected[key]
    assert (ROOT / "launch" / "xla_spawn.py").is_file()


def test_run_passes_extra_training_args_through_after_the_recipe():
    (words,) = dry_run("run.sh", *LOCATION, "--num-cores", "8", "--",
                       "--output_dir", "/tmp/out dir", "--do_train", "--name", "x")
    train = remote_commands(words)[-1]
    assert train[4:6] == ["--num_cores", "8"]
    assert train[-5:] == ["--output_dir", "/tmp/out dir", "--do_train", "--name", "x"]
    assert "--config_name" in train


def test_run_spmd_launches_one_process_per_worker():
    (words,) = dry_run("run.sh", *LOCATION, "--spmd")
    train = remote_commands(words)[-1]
    assert train[4:8] == ["--num_cores", "4", "--spmd", "launch/run_clm.py"]
    (plain,) = dry_run("run.sh", *LOCATION)
    assert "--spmd" not in remote_commands(plain)[-1]
    (per_chip,) = dry_run("run.sh", *LOCATION, "--per-chip")
    assert remote_commands(per_chip)[-1][4:8] == ["--num_cores", "4", "--per_chip", "launch/run_clm.py"]


def test_run_without_default_args_sends_only_the_given_ones():
    (words,) = dry_run("run.sh", *LOCATION, "--no-default-args", "--", "--config_name", "c.json")
    train = remote_commands(words)[-1]
    assert train[6:] == ["launch/run_clm.py", "--config_name", "c.json"]


def test_copy_results_from_worker_0_by_default():
    mkdir, scp = dry_run("copy_results.sh", *LOCATION)
    assert mkdir == ["mkdir", "-p", "results/worker-0"]
    assert scp[:6] == TPU_VM + ["scp", "--recurse"]
    assert "my-tpu:/tmp/test-clm" in scp and "results/worker-0/" in scp
    assert flag_value(scp, "--worker") == "0"


def test_copy_results_from_all_workers_into_separate_folders():
    commands = dry_run("copy_results.sh", *LOCATION, "--worker", "all", "--num-workers", "3",
                       "--output-dir", "/tmp/o", "--dest", "out")
    scps = [c for c in commands if c[:5] == TPU_VM + ["scp"]]
    assert [flag_value(c, "--worker") for c in scps] == ["0", "1", "2"]
    assert [c[c.index("my-tpu:/tmp/o") + 1] for c in scps] == [
        "out/worker-0/", "out/worker-1/", "out/worker-2/"]


def test_copy_results_all_workers_needs_a_count():
    result = script("copy_results.sh", *LOCATION, "--worker", "all", "--dry-run")
    assert result.returncode == 2
    assert "--worker all needs --num-workers N" in result.stderr


def test_delete_prints_delete_and_only_skips_the_prompt_with_yes():
    (words,) = dry_run("delete.sh", *LOCATION)
    assert words[:6] == TPU_VM + ["delete", "my-tpu"] and "--quiet" not in words
    (words,) = dry_run("delete.sh", *LOCATION, "--yes", "--project=p")
    assert "--quiet" in words and flag_value(words, "--project") == "p"


@pytest.mark.parametrize("name", ENTRY_SCRIPTS)
def test_unknown_option_lists_the_valid_ones(name):
    result = script(name, *LOCATION, "--acelerator", "v4-8", "--dry-run")
    assert result.returncode == 2
    assert f"{name}: error: unknown option '--acelerator'; valid options:" in result.stderr
    for option in ("--name VALUE", "--zone VALUE", "--dry-run", "--help"):
        assert option in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("name", ENTRY_SCRIPTS)
def test_missing_required_option(name):
    result = script(name, "--zone", "z", "--dry-run")
    assert result.returncode == 2
    assert "--name is required" in result.stderr


@pytest.mark.parametrize("name", ENTRY_SCRIPTS)
def test_help_exits_zero(name):
    result = script(name, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: {name}")


def test_option_missing_its_value():
    result = script("create.sh", "--name", "--zone", "z", "--dry-run")
    assert result.returncode == 2
    assert "--name needs a value, got option '--zone'" in result.stderr


def test_run_rejects_a_bad_core_count():
    result = script("run.sh", *LOCATION, "--num-cores", "four", "--dry-run")
    assert result.returncode == 2
    assert "--num-cores must be a positive integer, got 'four'" in result.stderr


@pytest.mark.parametrize("name", ALL_SCRIPTS)
def test_bash_syntax(name):
    result = subprocess.run(["bash", "-n", str(SCRIPTS_DIR / name)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    result = subprocess.run(["shellcheck", "-x", *(f"tpu_scripts/{n}" for n in ALL_SCRIPTS)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_dry_run_the_command_runs_and_its_failure_stops_the_script():
    # gcloud here is the failing guard from _no_real_gcloud: exit 99 must surface.
    result = script("create.sh", *LOCATION)
    assert result.returncode == 99
    assert "test ran gcloud for real" in result.stderr
    assert result.stdout == ""


def test_create_asks_for_spot_capacity_only_when_told():
    (words,) = dry_run("create.sh", *LOCATION, "--spot")
    assert words[-1] == "--spot"
    (plain,) = dry_run("create.sh", *LOCATION)
    assert "--spot" not in plain


def _fake(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_auto_resume_runs_the_job_again_after_each_preemption_exit_on_the_worker(tmp_path):
    """The worker-side text run.sh ships, run by bash here: a job that exits 75 (it saved a
    checkpoint for a SIGTERM) runs again, at most --auto-resume times; any other status ends it."""
    (words,) = dry_run("run.sh", *LOCATION, "--auto-resume", "2", "--no-default-args", "--", "--max_steps", "3")
    remote = flag_value(words, "--command")
    (tmp_path / "xla_fsdp" / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / "xla_fsdp" / ".venv" / "bin" / "activate").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    runs = tmp_path / "runs"
    # python3 here: the job; it exits with the next status of $STATUSES, one per run, and records its arguments
    _fake(bin_dir, "python3", f'echo "$*" >> {runs}\nn=$(wc -l < {runs})\n'
                              'set -- $STATUSES\nshift $((n - 1))\nexit "$1"\n')

    def worker(statuses):
        runs.unlink(missing_ok=True)
        got = subprocess.run(["bash", "-c", remote], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STATUSES=statuses))
        return got.returncode, runs.read_text().splitlines(), got.stderr

    code, calls, said = worker("75 75 0")
    assert code == 0 and len(calls) == 3, (code, calls, said)
    assert all(c.endswith("launch/run_clm.py --max_steps 3") for c in calls), calls
    assert "resuming (1 of 2)" in said and "resuming (2 of 2)" in said, said
    code, calls, _ = worker("75 75 75 0")  # the third preemption exit is past --auto-resume 2
    assert code == 75 and len(calls) == 3, (code, calls)
    code, calls, _ = worker("1 0")  # a failure is not a preemption: no rerun
    assert code == 1 and len(calls) == 1, (code, calls)


@pytest.mark.parametrize("state", ["READY", "PREEMPTED"])
def test_auto_resume_reconnects_only_while_the_vm_is_ready(tmp_path, state):
    """A broken connection (ssh's 255): run.sh asks the VM's state; READY runs the job again, any
    other state ends with the state named and what to do."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _fake(bin_dir, "gcloud", f'echo "$4" >> {calls}\n'
                             f'case "$4" in describe) echo {state};; ssh) [ "$(grep -c ssh {calls})" -gt 1 ] '
                             '&& exit 0 || exit 255;; esac\n')
    got = subprocess.run(["bash", str(SCRIPTS_DIR / "run.sh"), *LOCATION, "--auto-resume", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"))
    made = calls.read_text().split()
    if state == "READY":
        assert got.returncode == 0 and made == ["ssh", "describe", "ssh"], (got.stderr, made)
        assert "is READY; running the job again (1 of 1)" in got.stderr
    else:
        assert got.returncode == 255 and made == ["ssh", "describe"], (got.stderr, made)
        assert "'PREEMPTED', not READY" in got.stderr and "create it again" in got.stderr, got.stderr


def test_auto_resume_needs_a_count():
    got = script("run.sh", *LOCATION, "--auto-resume", "often")
    assert got.returncode == 2 and "--auto-resume must be a count" in got.stderr, got.stderr


# Multislice: --node-count N > 1 is a queued resource NAME whose nodes (slices) are NAME-0 .. NAME-(N-1).
QUEUED = ["gcloud", "compute", "tpus", "queued-resources"]
TWO_SLICES = [*LOCATION, "--node-count", "2"]


def test_create_multislice_asks_for_a_queued_resource_of_n_nodes():
    (words,) = dry_run("create.sh", *TWO_SLICES, "--accelerator-type", "v4-8", "--project", "proj-1")
    assert words[:6] == QUEUED + ["create", "my-tpu"]
    assert flag_value(words, "--node-count") == "2"
    assert flag_value(words, "--node-prefix") == "my-tpu"  # its nodes: my-tpu-0, my-tpu-1
    assert flag_value(words, "--accelerator-type") == "v4-8"
    assert flag_value(words, "--runtime-version") == "tpu-ubuntu2204-base"
    assert flag_value(words, "--zone") == "us-central2-b" and flag_value(words, "--project") == "proj-1"
    assert "--spot" not in words and not any(w.startswith("--version") for w in words)
    (spot,) = dry_run("create.sh", *TWO_SLICES, "--spot")
    assert spot[:6] == QUEUED + ["create", "my-tpu"] and spot[-1] == "--spot"


def test_install_multislice_installs_every_node_in_turn():
    archive, scp0, ssh0, scp1, ssh1 = dry_run("install.sh", *TWO_SLICES)
    (_, _, one_vm) = dry_run("install.sh", *LOCATION)
    assert archive[:4] == ["git", "-C", str(ROOT), "archive"]  # made once, sent to each node
    tarball = flag_value(archive, "--output")
    for node, scp, ssh in (("my-tpu-0", scp0, ssh0), ("my-tpu-1", scp1, ssh1)):
        assert scp == TPU_VM + ["scp", tarball, f"{node}:xla_fsdp-src.tar.gz", "--zone=us-central2-b", "--worker=all"]
        assert ssh[:6] == TPU_VM + ["ssh", node] and "--worker=all" in ssh
        assert flag_value(ssh, "--command") == flag_value(one_vm, "--command")
    ssh0, ssh1 = dry_run("install.sh", *TWO_SLICES, "--repo-url", "https://example.com/x.git")
    assert [ssh0[5], ssh1[5]] == ["my-tpu-0", "my-tpu-1"]
    assert ["git", "-C", "xla_fsdp", "checkout", "main"] in remote_commands(ssh1)


@pytest.mark.parametrize("options", [[], ["--auto-resume", "2", "--per-chip", "--", "--max_steps", "20"]])
def test_run_multislice_starts_the_job_on_every_worker_of_every_slice_in_one_command(options):
    (words,) = dry_run("run.sh", *TWO_SLICES, *options)
    (one_vm,) = dry_run("run.sh", *LOCATION, *options)
    assert words[:6] == QUEUED + ["ssh", "my-tpu"]
    assert flag_value(words, "--node") == "all" and flag_value(words, "--worker") == "all"
    assert flag_value(words, "--zone") == "us-central2-b"
    # the same job as on one slice: the platform sets MEGASCALE_* on every host
    assert flag_value(words, "--command") == flag_value(one_vm, "--command")
    assert "launch/xla_spawn.py" in flag_value(words, "--command")


def test_copy_results_multislice_copies_each_node_into_its_folder():
    commands = dry_run("copy_results.sh", *TWO_SLICES, "--worker", "all", "--num-workers", "2",
                       "--output-dir", "/tmp/o", "--dest", "out")
    mkdirs = [c for c in commands if c[0] == "mkdir"]
    scps = [c for c in commands if c[:5] == TPU_VM + ["scp"]]
    expected = [("my-tpu-0", "0", "out/node-0/worker-0"), ("my-tpu-0", "1", "out/node-0/worker-1"),
                ("my-tpu-1", "0", "out/node-1/worker-0"), ("my-tpu-1", "1", "out/node-1/worker-1")]
    assert len(commands) == 8 and mkdirs == [["mkdir", "-p", dest] for _, _, dest in expected]
    assert [(c[6].split(":")[0], flag_value(c, "--worker"), c[7]) for c in scps] == [
        (node, w, dest + "/") for node, w, dest in expected]
    assert all(c[6].endswith(":/tmp/o") for c in scps)


def test_delete_multislice_force_deletes_the_queued_resource_and_only_skips_the_prompt_with_yes():
    (words,) = dry_run("delete.sh", *TWO_SLICES)
    assert words == QUEUED + ["delete", "my-tpu", "--zone=us-central2-b", "--force"]
    (words,) = dry_run("delete.sh", *TWO_SLICES, "--yes")
    assert words == QUEUED + ["delete", "my-tpu", "--zone=us-central2-b", "--force", "--quiet"]


@pytest.mark.parametrize("bad", ["0", "x", "-1", "1.5"])
@pytest.mark.parametrize("name", ENTRY_SCRIPTS)
def test_bad_node_count_is_refused_naming_it(name, bad):
    result = script(name, *LOCATION, "--node-count", bad, "--dry-run")
    assert result.returncode == 2, result.stderr
    assert f"{name}: error: --node-count must be a positive integer" in result.stderr
    assert f"got '{bad}'" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("name", ENTRY_SCRIPTS)
def test_node_count_1_prints_what_no_option_prints(name):
    options = [*LOCATION, "--project", "p"] + (["--worker", "all", "--num-workers", "2"]
                                             if name == "copy_results.sh" else [])
    one = script(name, "--dry-run", *options, "--node-count", "1")
    assert one.returncode == 0, one.stderr
    assert one.stdout == script(name, "--dry-run", *options).stdout
    assert "queued-resources" not in one.stdout and "my-tpu-0" not in one.stdout


@pytest.mark.parametrize("state", ["ACTIVE", "SUSPENDED"])
def test_multislice_auto_resume_reconnects_only_while_the_queued_resource_is_active(tmp_path, state):
    """With --node-count 2 a broken connection asks the queued resource's state (not a VM's): ACTIVE
    runs the one all-slices command again, any other state ends with the state named and what to do."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _fake(bin_dir, "gcloud", f'echo "$3 $4 $5 ${{@: -1}}" >> {calls}\n'
                             f'case "$4" in describe) echo {state};; ssh) [ "$(grep -c " ssh " {calls})" -gt 1 ] '
                             '&& exit 0 || exit 255;; esac\n')
    got = subprocess.run(["bash", str(SCRIPTS_DIR / "run.sh"), *TWO_SLICES, "--auto-resume", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"))
    made = [line.split(" ", 3) for line in calls.read_text().splitlines()]
    assert all(call[:3] in (["queued-resources", "ssh", "my-tpu"], ["queued-resources", "describe", "my-tpu"])
               for call in made), made
    describe = ["queued-resources", "describe", "my-tpu", "--format=value(state.state)"]
    if state == "ACTIVE":
        assert got.returncode == 0 and [c[1] for c in made] == ["ssh", "describe", "ssh"], (got.stderr, made)
        assert made[1] == describe
        assert "my-tpu is ACTIVE; running the job again (1 of 1)" in got.stderr
    else:
        assert got.returncode == 255 and [c[1] for c in made] == ["ssh", "describe"], (got.stderr, made)
        assert "the queued resource is 'SUSPENDED', not ACTIVE" in got.stderr, got.stderr
        assert "delete it and create it again" in got.stderr and "--node-count 2" in got.stderr, got.stderr
