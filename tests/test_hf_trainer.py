"""Hugging Face Trainer on xla_fsdp (`xla_fsdp.integrations.transformers.enable()`), on XLA:CPU.

A real `transformers.Trainer` (tests/fixtures/hf_trainer_job.py) trains a tiny
GPT-2 on the embedded corpus with the blog's fsdp_config (`"xla": true`,
GPT2Block units, bf16 compute, `xla_fsdp_grad_ckpt`), gradient accumulation
2 and clipping, saving a checkpoint every 2 steps. A second Trainer resumes
from checkpoint-2 and must log the same losses for steps 3 and 4; the final
`save_model` directory loads with `GPT2LMHeadModel.from_pretrained` and
computes the trained model's logits. The same with `"xla_fsdp_v2": true` on
the GSPMD engine and 4 devices. One process (Trainer's world size is 1 here:
multi-process XLA does not run on CPU). Default run: the collectives engine's single controller
with scan_layers (4 devices); the blog's config at one device and the GSPMD engine under `-m slow`.

At 4 devices under launch/xla_spawn.py (one process, XLA_FSDP_RUNTIME=single_controller):
tests/fixtures/hf_clm_job.py, a script in the style of Hugging Face's run_clm.py with
only the two lines added, trains GPT-2 and Llama on a text file with a tokenizer-style
attention_mask (padding zeros, or run_clm's all-ones blocks) in both engines; its
losses equal the unsharded Trainer's within 1e-5 (f32), a resume from checkpoint-2 logs
the same losses, and the final model loads with from_pretrained. Default run: the
collective engine on padded GPT-2; the rest under `pytest -m slow`.
tests/fixtures/hf_host_reads.py: host reads inside the manual region are Python errors
naming the line, and transformers' mask code takes the paths that read nothing.
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
CLM = os.path.join(ROOT, "tests", "fixtures", "hf_clm_job.py")
HOST_READS = os.path.join(ROOT, "tests", "fixtures", "hf_host_reads.py")
SPAWN = os.path.join(ROOT, "launch", "xla_spawn.py")
CONFIGS = {"v1": (os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp.json"), 1, []),
           "v2": (os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp_v2.json"), 4, ["--v2"]),
           "v2_scan": (os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp_v2_scan.json"), 4, ["--v2"]),
           "v1_scan": (os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp_scan.json"), 4, ["--spmd", "--adafactor"])}


def _job(out, flavour, *extra):
    config, devices, flags = CONFIGS[flavour]
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, JOB, str(out), config, "4", *flags, *extra], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "log.json").read_text())


# v2 (the GSPMD engine, 4 devices) under `pytest -m slow`: keeps the default run short
# v2_scan, v1_scan: scan_layers' stored stacks through the Trainer (checkpoints, save_model) on the
# GSPMD engine (AdamW) and on the collectives engine's single controller (4 devices) with the recipe's
# --optim adafactor, which runs per layer on the stacks ([Note: Adafactor on stored stacks])
# v1 (the blog's config at one device) under `pytest -m slow` too: the Trainer trains, resumes and saves on
# the collectives engine in the default run with v1_scan (4 devices, the single controller, bf16 compute
# and checkpointed GPT2Blocks, scanned) and test_clm_script_at_4_devices_under_xla_spawn
@pytest.mark.parametrize("flavour", [pytest.param("v1", marks=pytest.mark.slow),
                                     pytest.param("v2", marks=pytest.mark.slow),
                                     pytest.param("v2_scan", marks=pytest.mark.slow),
                                     "v1_scan"])
def test_trainer_trains_resumes_and_saves_with_xla_fsdp(tmp_path, flavour):
    from transformers import GPT2LMHeadModel

    whole = _job(tmp_path / "whole", flavour)
    assert "XlaFullyShardedDataParallel" in whole["mro"], whole["mro"]  # our engine, not torch_xla's
    if flavour.endswith("_scan"):  # the layers' parameters stored stacked
        assert "transformer.h_scan.attn.c_attn.weight" in whole["params"], whole["params"]
    assert whole["optimizer"] == ("Adafactor" if "--adafactor" in CONFIGS[flavour][2] else "AdamW")
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


def test_trainer_fsdp_config_keys_reach_the_engine_or_are_refused():
    """`scan_layers` reaches the engine (it was dropped: Trainer jobs ran unscanned); with xla_fsdp_v2,
    xla_fsdp_settings other than the dtypes are refused instead of dropped."""
    from types import SimpleNamespace

    from xla_fsdp.integrations.transformers import wrap_model

    def args(settings=None, **extra):
        return SimpleNamespace(fsdp_config={"xla": True, "min_num_params": 0, **extra}, xla_fsdp_config=settings or {})

    # scan_layers without checkpointed layers: the collectives engine's own refusal proves the key arrived
    with pytest.raises(ValueError, match="scan_layers=True scans the repeated layer"):
        wrap_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), args(scan_layers=True, min_num_params=-1), False)
    with pytest.raises(ValueError, match=r"\['flatten_parameters'\] have no effect with xla_fsdp_v2"):
        wrap_model(torch.nn.Linear(4, 4), args({"compute_dtype": torch.float32, "flatten_parameters": True}), True)


# -- run_clm-style script at 4 devices under xla_spawn --------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from xla_fsdp.train.data import embedded_documents

    lines = [line.strip() for doc in embedded_documents()[:60] for line in doc.split("\n") if line.strip()]
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text("\n".join(lines[:200]) + "\n")
    return path


def _clm(out, corpus, devices, *flags):
    """hf_clm_job.py: plain Python at 1 device (no FSDP: the unsharded reference), else
    `xla_spawn --num_cores devices`. Gradient accumulation 2 (the Trainer's num_items_in_batch
    counts both micro-batches), clipping at 1.0 (the default); the default optimizer
    (adamw_torch_fused) is left in."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), PYTHONPATH=ROOT)
    for name in ("XLA_USE_SPMD", "XLA_FSDP_RUNTIME", "XLA_FSDP_ENGINE"):
        env.pop(name, None)
    launcher = [SPAWN, "--num_cores", str(devices)] if devices > 1 else []
    cmd = [sys.executable, *launcher, CLM, "--output_dir", str(out), "--train_file", str(corpus), "--max_steps", "4",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
           "--save_steps", "2",
           "--learning_rate", "3e-3", "--report_to", "none", "--seed", "0", "--dataloader_drop_last", *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    log = json.loads((out / "log.json").read_text())
    return {int(k): v for k, v in log["losses"].items()}, log, proc.stderr


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, corpus):
    runs = {}

    def get(model, pad):
        if (model, pad) not in runs:
            out = tmp_path_factory.mktemp(f"ref_{model}_{pad}")
            runs[model, pad] = (_clm(out, corpus, 1, "--model_type", model, *(["--pad"] if pad else []))[0], out)
        return runs[model, pad]
    return get


@pytest.mark.parametrize("engine,model,pad", [
    ("collectives", "gpt2", True),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("collectives", "llama", True), ("collectives", "gpt2", False),
        ("spmd", "gpt2", True), ("spmd", "llama", True), ("spmd", "gpt2", False)]],
])
def test_clm_script_at_4_devices_under_xla_spawn(tmp_path, corpus, unsharded, engine, model, pad):
    from transformers import AutoModelForCausalLM

    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"xla": True, "xla_fsdp_v2": engine == "spmd",
                               "xla_fsdp_settings": {"compute_dtype": "float32"}}))
    flags = ["--model_type", model, *(["--pad"] if pad else []), "--fsdp", "--fsdp_config", str(cfg)]
    losses, log, stderr = _clm(tmp_path / "whole", corpus, 4, *flags)
    assert log["world_size"] == 1 and "XlaFullyShardedDataParallel" in log["mro"], log  # one process, our engine
    assert "training with torch.optim.AdamW unfused" in stderr  # transformers' fused default on XLA
    reference, ref_dir = unsharded(model, pad)
    assert sorted(losses) == [1, 2, 3, 4]
    for step in losses:
        assert losses[step] == pytest.approx(reference[step], rel=1e-5), (step, losses, reference)

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", resumed_dir / "checkpoint-2")
    resumed = _clm(resumed_dir, corpus, 4, *flags, "--resume")[0]
    assert [resumed[s] for s in (3, 4)] == [losses[s] for s in (3, 4)], (resumed, losses)  # exact

    ids = torch.arange(32).reshape(2, 16)
    with torch.no_grad():
        logits = {name: AutoModelForCausalLM.from_pretrained(str(d / "final"))(input_ids=ids).logits
                  for name, d in (("whole", tmp_path / "whole"), ("resumed", resumed_dir), ("unsharded", ref_dir))}
    torch.testing.assert_close(logits["resumed"], logits["whole"], rtol=0, atol=0)
    torch.testing.assert_close(logits["whole"], logits["unsharded"], rtol=1e-4, atol=1e-4)


def test_host_reads_in_the_manual_region_are_python_errors_and_hf_masks_read_nothing(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=ROOT)
    for name in ("XLA_USE_SPMD", "XLA_FSDP_RUNTIME"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, HOST_READS, str(tmp_path / "out.json")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert "item() of an XLA tensor" in out["item"] and "hf_host_reads.py:40 in forward" in out["item"], out
    assert "__bool__()" in out["branch"] and "hf_host_reads.py:50 in forward" in out["branch"], out
    for model in ("gpt2", "llama"):  # without enable(): transformers' mask code, by line
        assert "masking_utils.py" in out[f"{model}_unsteered"] and "_ignore_causal_mask_sdpa" in out[
            f"{model}_unsteered"] and "enable()" in out[f"{model}_unsteered"], out
        for engine in ("collectives", "spmd"):
            for mask in ("ones", "padded"):
                assert out[f"{model}_{engine}_{mask}"] <= 1e-5, out


def test_single_controller_runtime_set_up_too_late_names_the_fix():
    code = ("import torch, torch_xla; torch.ones(2).to(torch_xla.device())\n"
            "import xla_fsdp.integrations.transformers as t; t.enable()")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=ROOT, XLA_FSDP_RUNTIME="single_controller")
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1 and "RuntimeError: XLA_FSDP_RUNTIME=single_controller" in proc.stderr, proc.stderr
    assert "before any model or tensor is moved to the XLA device" in proc.stderr, proc.stderr


def test_xla_fsdp_v2_trainer_trains_with_default_pin_memory():
    """TrainingArguments' default dataloader_pin_memory=True under the SPMD runtime: torch's
    pin_memory fails in the loader's thread and the Trainer ended at step 0 ("not a single
    sample"); enable() turns it off. The step's loss is the one Hugging Face's own Trainer
    computes on the CPU for the same model and data."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=ROOT)
    env.pop("XLA_USE_SPMD", None)
    fixture = os.path.join(ROOT, "tests", "fixtures", "hf_trainer_spmd_step.py")
    results = {}
    # transformers' own Trainer away from XLA: no PJRT device, and its torch_xla detection off
    plain_env = {k: v for k, v in env.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    plain_env["USE_TORCH_XLA"] = "0"
    for name, flags, run_env in (("xla", [], env), ("plain", ["--plain"], plain_env)):
        proc = subprocess.run([sys.executable, fixture, *flags], env=run_env, capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        results[name] = (json.loads(lines[-1][len("RESULT "):]), proc.stderr)
    (r, stderr), (plain, _) = results["xla"], results["plain"]
    assert r["global_step"] == 1 and r["pin_memory"] is False, r
    assert abs(r["train_loss"] - plain["train_loss"]) <= 1e-5 * plain["train_loss"], (r, plain)
    assert "dataloader_pin_memory set to False" in stderr


def test_fused_adamw_becomes_unfused_on_xla_only(caplog):
    from types import SimpleNamespace

    from transformers import Trainer
    from transformers.training_args import OptimizerNames

    from xla_fsdp.integrations import transformers_runtime

    get = transformers_runtime.unfused_adamw(Trainer.get_optimizer_cls_and_kwargs).__func__

    def args(device):
        return SimpleNamespace(optim=OptimizerNames.ADAMW_TORCH_FUSED, learning_rate=1e-3, adam_beta1=0.9,
                               adam_beta2=0.999, adam_epsilon=1e-8, optim_args=None, device=torch.device(device))

    cls, kwargs = get(args("xla"))
    assert cls is torch.optim.AdamW and "fused" not in kwargs and kwargs["lr"] == 1e-3
    assert "--optim adamw_torch_fused (transformers' default) has no XLA kernel" in caplog.text
    assert get(args("cpu"))[1]["fused"] is True
