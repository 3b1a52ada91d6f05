"""The README's TPU command on a machine set up as tpu_scripts/install.sh sets up a TPU VM
(requirements.txt, which `make install` installs here too): it gets past every package it needs
and stops only where this machine differs from a TPU VM, the Hugging Face hub it cannot reach
(offline here), with one line saying so. Run as written but on XLA:CPU, with its own --output_dir.
"""
import os
import re
import shlex
import subprocess
import sys

from launcher_cases import ROOT, launcher_env
from test_tpu_scripts import LOCATION, dry_run


def _readme_tpu_command() -> list:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## On a TPU", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if "xla_spawn.py" in line]
    assert len(lines) == 1, block
    return shlex.split(lines[0])


def test_install_sh_installs_requirements_txt_which_has_every_package_the_tpu_command_needs():
    *_, ssh = dry_run("install.sh", *LOCATION)
    assert "pip install -r requirements.txt" in " ".join(ssh[-1:]), ssh
    pins = (ROOT / "requirements.txt").read_text()
    for package in ("transformers", "datasets"):  # --tokenizer_name, --dataset_name
        assert re.search(rf"^{package}==\S+$", pins, re.M), f"requirements.txt pins no {package}"


def test_the_readme_tpu_command_stops_only_at_the_unreachable_hub(tmp_path):
    words = _readme_tpu_command()
    assert words[:3] == ["python3", "-u", "launch/xla_spawn.py"], words
    out = words.index("--output_dir")
    words[out + 1] = str(tmp_path / "out")
    cache = words.index("--cache_dir")
    words[cache + 1] = str(tmp_path / "cache")
    env = launcher_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    assert "Traceback" not in said and "pip install" not in said, said[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "could not be loaded" in line]
    assert len(lines) == 1 and "hub is reachable" in lines[0], said[-3000:]
    assert not os.path.exists(tmp_path / "out")
