"""A new user's mistakes, made through the launcher as the README runs the job
(`python launch/xla_spawn.py --num_cores 4 launch/run_clm.py ...`, XLA:CPU), a few through
`--per_chip` and through the check (`python -m xla_fsdp.aot`): each ends with a non-zero exit
and one line naming the flag or key, never a traceback or silence, and leaves --output_dir as
it was. The launches run two at a time, once for the module; each case is a test of its own.
"""
import concurrent.futures
import os
import subprocess
import sys

import pytest

from launcher_cases import LAUNCHER, ROOT, launcher_env

RUN_CLM = str(ROOT / "launch" / "run_clm.py")
TINY = ["--config_name", str(ROOT / "configs" / "models" / "gpt2-tiny.json"), "--fsdp", "full_shard"]
FSDP = ["--fsdp_config", str(ROOT / "configs" / "fsdp" / "tiny_cpu.json")]

# name -> (files to write into the case's folder, run_clm flags ({d}: that folder), what the line names)
MISTAKES = {
    "fsdp_config key typo": ({"c.json": '{"xla": true, "fsdp_transformer_layer_cls_to_wrap": ["GPT2Block"],'
                                        ' "scan_layer": true}'},
                             [*TINY, "--fsdp_config", "{d}/c.json"], "unknown key 'scan_layer'"),
    "compute_dtype bf17": ({"c.json": '{"xla": true, "xla_fsdp_settings": {"compute_dtype": "bf17"}}'},
                           [*TINY, "--fsdp_config", "{d}/c.json"], "compute_dtype: unknown dtype 'bf17'"),
    "fsdp_config not JSON": ({"c.json": "not json {"}, [*TINY, "--fsdp_config", "{d}/c.json"],
                             "c.json: not valid JSON"),
    "BERT config": ({"bert.json": '{"model_type": "bert", "hidden_size": 64, "vocab_size": 300}'},
                    ["--config_name", "{d}/bert.json", "--fsdp", "full_shard"], "model_type 'bert'"),
    "config not JSON": ({"m.json": "{'n_embd': 64}"}, ["--config_name", "{d}/m.json"],
                        "--config_name {d}/m.json: not a JSON file"),
    "block_size over n_positions": ({}, [*TINY, *FSDP, "--block_size", "100000"],
                                    "--block_size 100000 exceeds n_positions 128"),
    "output_dir is a file": ({"afile": "mine"}, [*TINY, *FSDP, "--output_dir", "{d}/afile"],
                             "--output_dir {d}/afile exists and is a file"),
    "output_dir under a file": ({"afile": "mine"}, [*TINY, *FSDP, "--output_dir", "{d}/afile/run"],
                                "{d}/afile is a file"),
    "batch size 0": ({}, [*TINY, *FSDP, "--per_device_train_batch_size", "0"],
                     "--per_device_train_batch_size 0: must be at least 1"),
    "negative learning rate": ({}, [*TINY, *FSDP, "--learning_rate", "-1"], "--learning_rate -1: must be"),
    "missing train_file": ({}, [*TINY, *FSDP, "--train_file", "{d}/missing.txt"],
                           "--train_file {d}/missing.txt: no such file"),
    "max_steps 0": ({}, [*TINY, *FSDP, "--max_steps", "0"], "--max_steps 0: must be"),
    "missing checkpoint": ({}, [*TINY, *FSDP, "--resume_from_checkpoint", "{d}/nope"],
                           "--resume_from_checkpoint {d}/nope: no such directory"),
    "unknown optimizer": ({}, [*TINY, *FSDP, "--optim", "sgdx"], "--optim: invalid choice: 'sgdx'"),
    # found after the runtime started: the compile cache it made under --output_dir is removed again
    "wrap class not in the model": ({"c.json": '{"xla": true, "fsdp_transformer_layer_cls_to_wrap": ["NoBlock"]}'},
                                    [*TINY, "--fsdp_config", "{d}/c.json"], "names 'NoBlock', but no module"),
    "batch the text cannot fill": ({}, [*TINY, *FSDP, "--per_device_train_batch_size", "5000"],
                                   "one global batch needs 20000; lower --per_device_train_batch_size"),
}
# a few of them through the other doors
PER_CHIP = ("compute_dtype bf17", "batch size 0", "output_dir is a file")
CHECK = ("fsdp_config key typo", "batch size 0")
CASES = ([("launcher", name) for name in MISTAKES] + [("per_chip", name) for name in PER_CHIP]
         + [("check", name) for name in CHECK])


def _launch(door: str, name: str, base) -> tuple:
    folder = base / f"{door}-{name.replace(' ', '_')}"
    folder.mkdir()
    files, flags, _ = MISTAKES[name]
    for file, text in files.items():
        (folder / file).write_text(text)
    flags = [f.replace("{d}", str(folder)) for f in flags]
    if "--output_dir" not in flags:
        flags += ["--output_dir", str(folder / "out")]
    if door == "check":
        command = [sys.executable, "-m", "xla_fsdp.aot", "--tpu", "v4-8", "--", RUN_CLM, *flags]
    else:
        cores = ["--per_chip", "--num_cores", "1"] if door == "per_chip" else ["--num_cores", "4"]
        command = [sys.executable, str(LAUNCHER), *cores, RUN_CLM, *flags]
    before = sorted(os.listdir(folder))
    proc = subprocess.run(command, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=240)
    return proc, folder, before


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("mistakes")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # this machine's two cores
        futures = {case: pool.submit(_launch, *case, base) for case in CASES}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("door,name", CASES, ids=[f"{d}-{n.replace(' ', '_')}" for d, n in CASES])
def test_a_mistake_ends_with_one_line_naming_it_and_writes_nothing(launched, door, name):
    proc, folder, before = launched[(door, name)]
    said = proc.stdout + proc.stderr
    names = MISTAKES[name][2].replace("{d}", str(folder))
    assert proc.returncode != 0, said
    assert "Traceback" not in said, said
    lines = [line for line in proc.stderr.splitlines() if names in line]
    assert len(lines) == 1, f"expected one line on stderr naming {names!r}:\n{said}"
    assert sorted(os.listdir(folder)) == before, f"the job left {sorted(os.listdir(folder))} in {folder}"
    if name.startswith("output_dir"):
        assert (folder / "afile").read_text() == "mine"
