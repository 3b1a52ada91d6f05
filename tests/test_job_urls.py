"""run_clm with a URL --output_dir (issue 42): every file the job writes or reads goes
through fsspec, and nothing lands in the working directory (no local `gs:` or `file:` folder).

fsspec's file:// stands for a bucket where the job is a subprocess (memory:// lives in one
process); the flag checks run in-process against memory://. The same job against a real
bucket API (gcsfs and a GCS emulator) is tests/test_gcs_emulator.py.
"""
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from xla_fsdp.checkpoint import save_checkpoint, storage
from xla_fsdp.train.args import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "run_clm.py")
TINY = os.path.join(ROOT, "configs", "models", "gpt2-tiny.json")
FLAGS = ["--config_name", TINY, "--do_train", "--max_steps", "4", "--per_device_train_batch_size", "2",
         "--block_size", "32", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2"]


def _job(cwd, args, timeout=300):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for name in ("XLA_FSDP_ENGINE", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, SCRIPT] + args, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    return proc, proc.stdout + proc.stderr


@pytest.fixture
def url_root():
    url = f"memory://xla-fsdp-job/{uuid.uuid4().hex}"
    yield url
    storage.storage_for(url).rmtree(url, ignore_errors=True)


def test_a_url_output_dir_gets_every_file_and_the_working_dir_none(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    url = f"file://{tmp_path}/bucket/run"
    proc, out = _job(work, FLAGS + ["--output_dir", url])
    assert proc.returncode == 0, out[-4000:]
    assert os.listdir(work) == [], f"the job wrote into its working directory: {os.listdir(work)}"
    run = tmp_path / "bucket" / "run"
    assert {"metrics.json", "model.safetensors", "config.json", "checkpoint-2", "checkpoint-4"} <= set(os.listdir(run))
    assert json.loads((run / "metrics.json").read_text())["steps"] == 4
    assert f"metrics written to {url}/metrics.json" in out


def _plain_checkpoint(path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return save_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1), step=8)


def test_resume_from_an_explicit_url_checkpoint_is_accepted(url_root):
    path = _plain_checkpoint(f"{url_root}/checkpoint-8")
    args = parse_args(["--config_name", TINY, "--output_dir", url_root, "--resume_from_checkpoint", path])
    assert args.resume_from_checkpoint == path


def test_a_url_checkpoint_that_is_missing_or_incomplete_is_refused_by_name(url_root, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config_name", TINY, "--output_dir", url_root,
                    "--resume_from_checkpoint", f"{url_root}/checkpoint-3"])
    assert f"--resume_from_checkpoint {url_root}/checkpoint-3: no such directory" in capsys.readouterr().err
    path = _plain_checkpoint(f"{url_root}/checkpoint-8")
    storage.storage_for(path).remove(f"{path}/COMPLETE")  # as a save killed before its commit leaves it
    with pytest.raises(SystemExit):
        parse_args(["--config_name", TINY, "--output_dir", url_root, "--resume_from_checkpoint", path])
    assert "no COMPLETE marker" in capsys.readouterr().err


def test_the_trainer_integration_refuses_a_url_output_dir_before_making_a_folder(tmp_path):
    """transformers' Trainer writes --output_dir with os and shutil: a URL would become a local
    `gs:` folder at Trainer(...). The integration refuses it there, naming what works."""
    code = ("import torch, transformers\n"
            "from xla_fsdp.integrations import transformers as integration\n"
            "integration.enable()\n"
            "args = transformers.TrainingArguments(output_dir='gs://bucket/run', report_to=[])\n"
            "try:\n"
            "    transformers.Trainer(model=torch.nn.Linear(2, 2), args=args)\n"
            "except ValueError as e:\n"
            "    print('REFUSED:', e)\n")
    script, work = tmp_path / "trainer.py", tmp_path / "cwd"
    script.write_text(code)
    work.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=work, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED: --output_dir gs://bucket/run is a URL" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert os.listdir(work) == [], os.listdir(work)


def test_aot_dump_writes_a_url(tmp_path, url_root):
    from xla_fsdp.aot.cli import write_dump

    (tmp_path / "program.txt").write_text("HloModule traced")
    (tmp_path / "trace.log").write_text("log")
    write_dump(f"{url_root}/aot", str(tmp_path), "HloModule optimized")
    st = storage.storage_for(url_root)
    assert st.listdir(f"{url_root}/aot") == ["tpu_optimized.hlo.txt", "trace.log", "traced_step.hlo.txt"]
    assert st.read_bytes(f"{url_root}/aot/traced_step.hlo.txt") == b"HloModule traced"


def test_aot_dump_to_a_url_without_its_file_system_is_refused_before_the_trace(tmp_path, capsys):
    from xla_fsdp.aot.cli import EXIT_USAGE, main

    code = main(["--tpu", "v4-8", "--dump", "nosuchfs://bucket/aot", "--", sys.executable, SCRIPT,
                 "--config_name", TINY, "--output_dir", str(tmp_path / "o")])
    assert code == EXIT_USAGE
    assert "no file system for nosuchfs:// URLs" in capsys.readouterr().err


def test_inputs_read_by_other_libraries_refuse_a_url_by_name(capsys):
    for flag in ("--config_name", "--fsdp_config", "--cache_dir"):
        argv = ["--config_name", TINY, "--output_dir", "o", flag, "gs://bucket/x.json"]
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert f"{flag} gs://bucket/x.json: a URL; this flag takes a local path" in capsys.readouterr().err


def test_a_train_file_at_a_url_is_read_through_fsspec(url_root):
    from xla_fsdp.train.data import read_text_file

    storage.storage_for(url_root).write_bytes(f"{url_root}/corpus.txt", b"one doc\n\nanother doc\n")
    assert read_text_file(f"{url_root}/corpus.txt") == ["one doc", "another doc\n"]


def test_a_scheme_without_its_file_system_names_the_package(capsys):
    import importlib.util

    from xla_fsdp.train.output_dir import check_output_dir

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed")
    args = parse_args(["--config_name", TINY, "--output_dir", "s3://bucket/run"])
    with pytest.raises(SystemExit, match=r"--output_dir: paths s3://\.\.\. need s3fs.*pip install s3fs"):
        check_output_dir(args)
    with pytest.raises(SystemExit):
        parse_args(["--config_name", TINY, "--output_dir", "o", "--resume_from_checkpoint", "s3://b/run/checkpoint-4"])
    assert "need s3fs" in capsys.readouterr().err


def test_gs_without_gcsfs_names_gcsfs_even_where_it_is_installed(tmp_path):
    """gcsfs is a test dependency, so its absence is simulated in a child process."""
    script = tmp_path / "no_gcsfs.py"
    script.write_text("import sys\nsys.modules['gcsfs'] = None  # import gcsfs now fails\n"
                      "from xla_fsdp.train.args import parse_args\nfrom xla_fsdp.train.output_dir import check_output_dir\n"
                      f"check_output_dir(parse_args(['--config_name', {TINY!r}, '--output_dir', 'gs://b/run']))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("STORAGE_EMULATOR_HOST", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert ("--output_dir: paths gs://... need gcsfs, fsspec's file system for gs://, which is not installed: "
            "pip install gcsfs (or pip install xla_fsdp[gcs])") in proc.stderr, proc.stderr[-2000:]
