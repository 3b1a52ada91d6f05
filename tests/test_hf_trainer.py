"""Hugging Face Trainer on xla_fsdp (`xla_fsdp.integrations.transformers.enable()`), on XLA:CPU.

A real `transformers.Trainer` (tests/fixtures/hf_trainer_job.py) trains a tiny
GPT-2 on the embedded corpus with the blog's fsdp_config (`"xla": true`,
GPT2Block units, bf16 compute, `xla_fsdp_grad_ckpt`), gradient accumulation
2 and clipping, saving a checkpoint every 2 steps. A second Trainer resumes
from checkpoint-2 and must log the same losses for steps 3 and 4; the final
`save_model` directory loads with `GPT2LMHeadModel.from_pretrained` and
computes the trained model's logits. The same with `"xla_fsdp_v2": true` on
the GSPMD engine and 4 devices. One process (Trainer's world size is 1 here:
multi-process XLA does not run on CPU).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "fixtures", "hf_trainer_job.py")
CONFIGS = {"v1": (os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp.json"), 1, []),
           "v2": (os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp_v2.json"), 4, ["--v2"])}


def _job(out, flavour, *extra):
    config, devices, flags = CONFIGS[flavour]
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, JOB, str(out), config, "4", *flags, *extra], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "log.json").read_text())


# v2 (the GSPMD engine, 4 devices) under `pytest -m slow`: keeps the default run short
@pytest.mark.parametrize("flavour", ["v1", pytest.param("v2", marks=pytest.mark.slow)])
def test_trainer_trains_resumes_and_saves_with_xla_fsdp(tmp_path, flavour):
    from transformers import GPT2LMHeadModel

    whole = _job(tmp_path / "whole", flavour)
    assert "XlaFullyShardedDataParallel" in whole["mro"], whole["mro"]  # our engine, not torch_xla's
    losses = {int(k): v for k, v in whole["losses"].items()}
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1] - 0.3, losses
    assert sorted(os.listdir(tmp_path / "whole")) == ["checkpoint-2", "checkpoint-4", "final", "log.json"]

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = {int(k): v for k, v in _job(resumed_dir, flavour, "--resume")["losses"].items()}
    for step in (3, 4):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), (step, resumed, losses)

    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "whole" / "final"))
    assert model.lm_head.weight is model.transformer.wte.weight
    again = GPT2LMHeadModel.from_pretrained(str(resumed_dir / "final"))
    ids = torch.arange(32).reshape(1, 32)
    with torch.no_grad():  # both runs end at the same weights
        torch.testing.assert_close(model(input_ids=ids).logits, again(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_unsupported_transformers_version_is_refused(monkeypatch):
    import transformers

    import xla_fsdp.integrations.transformers as integration

    monkeypatch.setattr(transformers, "__version__", "4.40.0")
    with pytest.raises(RuntimeError, match=r"supports transformers 5.23.x; this is 4.40.0"):
        integration.enable()


@pytest.mark.parametrize("hf,forward,backward", [
    ({"forward_prefetch": "false", "backward_prefetch": "backward_post"}, False, "BACKWARD_POST"),
    ({"backward_prefetch": "NO_PREFETCH"}, True, None),
    ({}, True, "BACKWARD_PRE"),
])
def test_trainer_fsdp_config_prefetch_keys(hf, forward, backward):
    """Trainer's fsdp_config (after TrainingArguments stripped "fsdp_") carries forward_prefetch /
    backward_prefetch to the wrapped model; with xla_fsdp_v2 they are refused."""
    from types import SimpleNamespace

    from xla_fsdp.integrations.transformers import wrap_model

    def args(**extra):
        return SimpleNamespace(fsdp_config={"xla": True, "min_num_params": 0, **hf, **extra}, xla_fsdp_config={})

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    policy = wrap_model(model, args(), False)._fsdp_state.options.prefetch
    assert (policy.forward, policy.backward) == (forward, backward)
    if hf:
        with pytest.raises(ValueError, match="no effect with xla_fsdp_v2"):
            wrap_model(torch.nn.Linear(4, 4), args(), True)
    with pytest.raises(ValueError, match="backward_prefetch"):
        wrap_model(torch.nn.Linear(4, 4), args(backward_prefetch="later"), False)
