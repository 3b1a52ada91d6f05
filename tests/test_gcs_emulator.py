"""run_clm and the checkpoint tools against gs:// for real: gcsfs talking to a local GCS
emulator (tests/gcs_emulator.py; skipped, naming the package, without it).

Default run: the README's tiny job at 4 CPU devices (one process each, xla_spawn) with a
gs:// --output_dir, from an empty working directory: every file it writes is in the bucket
(checkpoints with their COMPLETE markers, the final model, metrics.json) and none in the
working directory; a load's requests, counted at the emulator (one ranged read per tensor, no
metadata per tensor). Under `-m slow`: a job SIGKILLed in the middle of a save, resumed from an
explicit gs:// checkpoint and from `auto`, both logging the uninterrupted run's losses;
rotation (--save_total_limit) in the bucket; consolidation from the bucket and an HF export
from it with a local one's logits; two virtual hosts (HYBRID, FULL) saving one checkpoint to
the bucket, consolidated bit for bit and resumed from it.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gcs_emulator import gcs_bucket, gcs_emulator  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPAWN = [os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", "4", os.path.join(ROOT, "launch", "run_clm.py")]
FLAGS = ["--config_name", os.path.join(ROOT, "configs", "models", "gpt2-tiny.json"), "--fsdp", "full_shard",
         "--fsdp_config", os.path.join(ROOT, "configs", "fsdp", "tiny_cpu.json"), "--do_train",
         "--per_device_train_batch_size", "2", "--block_size", "32", "--logging_steps", "1",
         "--save_strategy", "steps", "--save_steps", "4", "--seed", "3"]
RANK_FILES = ["extra-rank{:05d}.pt", "index-rank{:05d}.json", "shards-rank{:05d}.safetensors"]


def _env(emulator):
    env = dict(os.environ, PJRT_DEVICE="CPU", **emulator.env)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    for name in ("XLA_FSDP_ENGINE", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(name, None)
    return env


def _job(emulator, cwd, args, timeout=420):
    proc = subprocess.run([sys.executable] + SPAWN + FLAGS + args, env=_env(emulator), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(emulator, url):
    return json.loads(emulator.fs().cat(f"{url}/metrics.json".split("://", 1)[1]))


def _checkpoint_files(world):
    return sorted(["COMPLETE", "metadata.json", "hf_config.json"] + [f.format(r) for f in RANK_FILES for r in range(world)])


def test_run_clm_at_4_devices_writes_every_file_to_the_bucket(gcs_emulator, gcs_bucket, tmp_path):
    started = time.perf_counter()
    out = _job(gcs_emulator, tmp_path, ["--output_dir", gcs_bucket, "--max_steps", "8"])
    assert os.listdir(tmp_path) == [], f"the job wrote into its working directory: {os.listdir(tmp_path)}"
    objects = gcs_emulator.objects(gcs_bucket)
    top = sorted({o.split("/", 1)[0] for o in objects})
    assert top == ["checkpoint-4", "checkpoint-8", "config.json", "metrics.json", "model.safetensors"], objects
    for step in (4, 8):
        got = sorted(o.split("/", 1)[1] for o in objects if o.startswith(f"checkpoint-{step}/"))
        meta = json.loads(gcs_emulator.fs().cat(f"{gcs_bucket}/checkpoint-{step}/metadata.json".split("://", 1)[1]))
        assert got == _checkpoint_files(meta["world_size"]), got  # one writer per process (host)
    metrics = _metrics(gcs_emulator, gcs_bucket)
    assert metrics["steps"] == 8 and metrics["devices"] == 4
    assert f"metrics written to {gcs_bucket}/metrics.json" in out
    print(f"run_clm at 4 devices to the emulator: {time.perf_counter() - started:.1f} s")


def test_a_bucket_that_does_not_exist_is_named_before_training(gcs_emulator, tmp_path):
    from xla_fsdp.train.args import parse_args
    from xla_fsdp.train.output_dir import check_output_dir

    args = parse_args(FLAGS + ["--output_dir", "gs://no-such-bucket-xla-fsdp/run"])
    with pytest.raises(SystemExit, match=r"bucket gs://no-such-bucket-xla-fsdp does not exist .*gcloud storage "
                                         r"buckets create"):
        check_output_dir(args)
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", "gs://no-such-bucket-xla-fsdp/c",
                           "out"], env=_env(gcs_emulator), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bucket gs://no-such-bucket-xla-fsdp does not exist" in proc.stderr, proc.stderr


def test_the_emulator_gets_gcsfs_json_api_file_system(gcs_emulator):
    """Whatever gcsfs's default class (its experimental one probes a gRPC API for every
    bucket, ~a minute per operation against an emulator), STORAGE_EMULATOR_HOST gets the core."""
    import gcsfs.core

    from xla_fsdp.checkpoint import storage

    assert type(storage.storage_for(gcs_emulator.url).fs) is gcsfs.core.GCSFileSystem


def test_a_load_from_the_bucket_reads_each_range_once_without_metadata_requests(gcs_emulator, gcs_bucket):
    """[Note: ranged reads] (storage.py): a load asks the bucket for the bytes of each tensor
    once, and object metadata per file, not per tensor; no byte is fetched twice."""
    import torch

    from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint

    def plain(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(16)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        return model, opt

    model, opt = plain(0)
    path = save_checkpoint(f"{gcs_bucket}/ckpt", model, opt, step=1)
    fs = gcs_emulator.fs()
    stored = sum(fs.du(path.split("://", 1)[1], total=False).values())
    other, other_opt = plain(1)
    with gcs_emulator.requests() as counts:
        load_checkpoint(path, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    tensors = 3 * len(list(model.parameters()))  # each parameter and its two moments: one range each
    assert tensors <= counts["read"] <= tensors + 12, counts
    assert counts["metadata"] + counts["list"] <= 20, counts  # per file and marker, not per tensor
    assert counts["read_bytes"] <= stored, (counts, stored)  # nothing fetched twice or past a range


# -- slow: preemption, rotation, consolidation ------------------------------------------

@pytest.fixture(scope="module")
def preempted(gcs_emulator, tmp_path_factory):
    """An uninterrupted 12-step run (--save_total_limit 1), and the same job SIGKILLed while
    rank 0 uploads checkpoint-8's COMPLETE marker (the emulator holds that upload)."""
    work = tmp_path_factory.mktemp("cwd")
    whole = gcs_emulator.fresh("whole")
    _job(gcs_emulator, work, ["--output_dir", whole, "--max_steps", "12", "--save_total_limit", "1"])
    killed = gcs_emulator.fresh("killed")
    with gcs_emulator.hold_upload("checkpoint-8/COMPLETE") as held:
        proc = subprocess.Popen([sys.executable] + SPAWN + FLAGS + ["--output_dir", killed, "--max_steps", "12"],
                                env=_env(gcs_emulator), cwd=work, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            assert held.wait(timeout=420), "the job never reached checkpoint-8's COMPLETE marker"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its 4 workers
            proc.wait()
    return work, whole, killed


@pytest.mark.slow
def test_sigkill_during_a_save_then_resume_from_a_gs_checkpoint_and_from_auto(gcs_emulator, preempted):
    work, whole, killed = preempted
    objects = gcs_emulator.objects(killed)
    assert "checkpoint-4/COMPLETE" in objects and "checkpoint-8/metadata.json" in objects
    assert "checkpoint-8/COMPLETE" not in objects, "the held save was committed"
    want = dict(_metrics(gcs_emulator, whole)["losses"])

    # an incomplete checkpoint is refused by name, before the XLA runtime starts
    proc = subprocess.run([sys.executable] + SPAWN + FLAGS + ["--output_dir", gcs_emulator.fresh("refused"),
                          "--max_steps", "12", "--resume_from_checkpoint", f"{killed}/checkpoint-8"],
                          env=_env(gcs_emulator), cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no COMPLETE marker" in proc.stderr, proc.stderr[-2000:]

    explicit = gcs_emulator.fresh("explicit")
    out = _job(gcs_emulator, work, ["--output_dir", explicit, "--max_steps", "12",
                                    "--resume_from_checkpoint", f"{killed}/checkpoint-4"])
    assert f"resumed from {killed}/checkpoint-4 at step 4" in out
    out = _job(gcs_emulator, work, ["--output_dir", killed, "--max_steps", "12", "--resume_from_checkpoint", "auto"])
    assert f"resumed from {killed}/checkpoint-4 at step 4" in out
    for url in (explicit, killed):
        got = dict(_metrics(gcs_emulator, url)["losses"])
        assert sorted(got) == list(range(5, 13)), got
        for step, loss in got.items():
            assert loss == pytest.approx(want[step], rel=1e-5), (url, step)
    assert "checkpoint-12/COMPLETE" in gcs_emulator.objects(killed)
    assert os.listdir(work) == []


@pytest.mark.slow
def test_rotation_keeps_the_newest_checkpoints_in_the_bucket(gcs_emulator, preempted):
    _, whole, _ = preempted
    objects = gcs_emulator.objects(whole)
    assert sorted({o.split("/", 1)[0] for o in objects if o.startswith("checkpoint-")}) == ["checkpoint-12"]


@pytest.mark.slow
def test_consolidation_from_the_bucket(gcs_emulator, preempted):
    from safetensors.torch import load

    work, whole, _ = preempted
    target = f"{whole}/consolidated"
    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", f"{whole}/checkpoint-12",
                           target], env=_env(gcs_emulator), cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fs = gcs_emulator.fs()
    got = load(fs.cat(f"{target}/model.safetensors".split("://", 1)[1]))
    final = load(fs.cat(f"{whole}/model.safetensors".split("://", 1)[1]))  # the job's own export at step 12
    assert sorted(got) == sorted(final)
    assert all((got[k] == final[k]).all() for k in final)
    assert "config.json" in gcs_emulator.objects(target)
    assert os.listdir(work) == []


@pytest.mark.slow
def test_hf_export_from_the_bucket_gives_the_logits_of_a_local_export(gcs_emulator, preempted, tmp_path):
    """consolidate gs://.../checkpoint-12 into the bucket, download it, from_pretrained: the same
    logits as the same checkpoint copied to a local directory and consolidated there."""
    import torch
    from transformers import GPT2LMHeadModel

    work, whole, _ = preempted
    fs = gcs_emulator.fs()
    local_ckpt, local_hf, downloaded = tmp_path / "ckpt", tmp_path / "hf-local", tmp_path / "hf-bucket"
    fs.get(f"{whole}/checkpoint-12".split("://", 1)[1] + "/", str(local_ckpt), recursive=True)
    target = f"{whole}/hf-export"
    for src, dst in ((f"{whole}/checkpoint-12", target), (str(local_ckpt), str(local_hf))):
        proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", src, dst],
                              env=_env(gcs_emulator), cwd=work, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    fs.get(target.split("://", 1)[1] + "/", str(downloaded), recursive=True)
    assert sorted(os.listdir(downloaded)) == sorted(os.listdir(local_hf)), os.listdir(downloaded)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [GPT2LMHeadModel.from_pretrained(str(d)).eval()(input_ids=ids).logits for d in (downloaded, local_hf)]
    assert logits[0].equal(logits[1])


# -- slow: two virtual hosts writing one checkpoint to the bucket -------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", ["HYBRID_SHARD", "FULL_SHARD"])
def test_two_virtual_hosts_save_to_the_bucket_and_load_back(gcs_emulator, layout, tmp_path):
    """Two hosts (4 XLA:CPU devices each, the single controller) save one checkpoint to gs://:
    every row once, each in a host that holds it; consolidating it from the bucket gives the
    hosts' own export bit for bit; both hosts resume from the bucket on the reference curve."""
    import torch
    from safetensors.torch import load_file

    import test_pod_checkpoints as pods
    import virtual_hosts as vh

    root = gcs_emulator.fresh(f"hosts-{layout.lower()}")
    exported = str(tmp_path / "exported")

    def run(*args):
        port = vh.free_port()
        vh.finish(vh.start({f"host {i} of 2": ([sys.executable, pods.SCRIPT, *args],
                                                dict(vh.host_env(2, i, port, pods.DEVICES), **gcs_emulator.env))
                            for i in range(2)}, cwd=tmp_path), 600)

    run("save", "collectives", layout, pods.KIND, root, exported, "export")
    path = f"{root}/checkpoint-{pods.cc.K}"
    assert "COMPLETE" in gcs_emulator.objects(path)
    local = tmp_path / "copy"
    gcs_emulator.fs().get(path.split("://", 1)[1] + "/", str(local), recursive=True)
    pods.check_files(str(local), 2, layout)

    proc = subprocess.run([sys.executable, "-m", "xla_fsdp.checkpoint", "consolidate", path, str(tmp_path / "hf")],
                          env=_env(gcs_emulator), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = load_file(os.path.join(exported, "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    out = str(tmp_path / "resumed")
    run("resume", "collectives", layout, pods.KIND, root, out)
    pods.check_resumed(out, 2, layout, "collectives")
