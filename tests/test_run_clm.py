"""launch/run_clm.py end to end on XLA:CPU at world size 1, and its flag errors.

The training run is a subprocess (as users run it); the error cases call
`main(argv)` in-process, since they all fail before the XLA runtime starts.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "run_clm.py")
TINY = {"model_type": "gpt2", "vocab_size": 512, "n_positions": 128, "n_embd": 128, "n_layer": 2,
        "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": 256, "eos_token_id": 256}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    shipped = os.path.join(ROOT, "configs", "models", "gpt2-tiny.json")
    if os.path.exists(shipped):
        return shipped
    path = tmp_path_factory.mktemp("cfg") / "gpt2-tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _run_clm():
    spec = importlib.util.spec_from_file_location("run_clm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECIPE_FSDP_CONFIG = os.path.join(ROOT, "configs", "fsdp", "gpt2_xla_fsdp.json")
TINY_FSDP_CONFIG = os.path.join(ROOT, "configs", "fsdp", "tiny_cpu.json")


def _train(tmp_path, args, launcher_cores=None, env_extra=None):
    """Run run_clm in a subprocess as a user would; returns (metrics.json, output)."""
    out = tmp_path / "out"
    env = dict(os.environ, PJRT_DEVICE="CPU")
    for name in ("XLA_FSDP_ENGINE", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "TF_CPP_MIN_LOG_LEVEL"):
        env.pop(name, None)
    env.update(env_extra or {})
    prefix = [sys.executable]
    if launcher_cores:
        prefix += [os.path.join(ROOT, "launch", "xla_spawn.py"), "--num_cores", str(launcher_cores)]
    cmd = prefix + [SCRIPT, "--output_dir", str(out)] + args
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), proc.stdout + proc.stderr


def test_trains_at_world_size_1_and_writes_metrics(tiny_config, tmp_path):
    # The recipe's flags at world size 1: collectives engine (every collective
    # present, trivially), GPT2Block units, bf16 compute and per-layer
    # checkpointing from the recipe's fsdp_config, Adafactor.
    if not os.path.exists(RECIPE_FSDP_CONFIG):
        pytest.skip("configs/fsdp/gpt2_xla_fsdp.json not in this checkout")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("left over from a previous run")
    report, output = _train(tmp_path, [
        "--config_name", tiny_config, "--overwrite_output_dir", "--do_train", "--do_eval",
        "--fsdp", "full_shard auto_wrap", "--fsdp_config", RECIPE_FSDP_CONFIG,
        "--optim", "adafactor", "--adafactor", "true", "--max_steps", "16",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "32",
        "--block_size", "64", "--learning_rate", "3e-3", "--warmup_steps", "2",
        "--logging_steps", "4", "--seed", "7"])
    assert "tokens/s" in output and "MFU" in output

    losses = [loss for _, loss in report["losses"]]
    assert [s for s, _ in report["losses"]] == [1, 4, 8, 12, 16]
    # From ln(vocab) ~ 6.2 at random init; byte-level English drops fast.
    assert losses[0] > 5.0
    assert losses[-1] < losses[0] - 1.5, losses
    assert report["engine"] == "collectives" and report["devices"] == 1 and report["steps"] == 16
    from transformers import GPT2Config
    from xla_fsdp.metrics import gpt2_num_params
    assert report["params"] == gpt2_num_params(GPT2Config.from_json_file(tiny_config))
    assert report["global_batch"] == 8 and report["block_size"] == 64
    assert report["tokens_per_step"] == 8 * 64
    assert report["flops_per_step"] == 6 * report["params"] * 512
    assert report["chips"] == 1 and "measured" in report["peak_source"]
    assert report["tokens_per_s"] > 0 and 0 < report["mfu"] < 2
    # MFU is the reported throughput over the measured peak, not a separate guess.
    assert report["mfu"] == pytest.approx(
        report["flops_per_step"] / report["step_time_s"] / report["peak_flops_per_chip"])
    assert math.isfinite(report["eval_loss"]) and report["eval_loss"] < losses[0]
    assert report["perplexity"] == pytest.approx(math.exp(report["eval_loss"]))
    assert report["wall_time_s"] > 0
    # Changing learning rates must not recompile every step: a handful of
    # graphs (fwd/bwd/step, first optimizer step, eval) at most.
    assert report["xla_compiles"] <= 8


# collectives under -m slow: the launcher's single controller is the gspmd case's; run_clm on the collectives
# engine through the launcher runs in the default run in tests/test_run_clm_llama.py (collectives_scan, 4
# devices, the unsharded run's losses) and tests/test_fused_loss.py
@pytest.mark.parametrize("config,engine", [pytest.param(TINY_FSDP_CONFIG, "collectives", marks=pytest.mark.slow),
                                           (TINY_FSDP_CONFIG.replace("tiny_cpu", "tiny_cpu_v2"), "spmd")],
                         ids=["collectives", "gspmd"])
def test_both_engines_through_the_launcher(tiny_config, tmp_path, config, engine):
    # The README main command's shape, shortened: CPU --num_cores N>1 runs one
    # process driving N devices; per-device batch x N devices. Both engines see
    # the same data and start from the same model, so they log the same losses.
    report, output = _train(tmp_path, [
        "--config_name", tiny_config, "--fsdp", "full_shard", "--fsdp_config", config,
        "--do_train", "--max_steps", "8", "--per_device_train_batch_size", "4",
        "--block_size", "32", "--logging_steps", "4", "--learning_rate", "3e-3"], launcher_cores=2)
    # quiet by default: XLA's per-compile GSPMD deprecation warning is not the user's to act on
    assert XLA_GSPMD_WARNING not in output, output[-2000:]
    losses = [loss for _, loss in report["losses"]]
    assert report["engine"] == engine and report["devices"] == 2
    assert report["runtime"] == "single_controller"
    assert report["global_batch"] == 2 * 4 and report["tokens_per_step"] == 8 * 32
    assert losses[-1] < losses[0] - 1.0, losses
    # every program it compiled is kept in compile_cache/host-0 under the local --output_dir
    cache = tmp_path / "out" / "compile_cache" / "host-0"
    assert report["compile_cache"]["path"] == str(cache)
    assert report["compile_cache"]["PersistentCacheMiss"] == len(os.listdir(cache)) > 0, report["compile_cache"]


XLA_GSPMD_WARNING = "GSPMD sharding propagation is going to be deprecated"


@pytest.mark.slow
def test_a_log_level_the_user_set_wins(tiny_config, tmp_path):
    _, output = _train(tmp_path, [
        "--config_name", tiny_config, "--fsdp", "full_shard", "--fsdp_config", TINY_FSDP_CONFIG,
        "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "2", "--block_size", "32"],
        launcher_cores=2, env_extra={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert XLA_GSPMD_WARNING in output


def test_unknown_flag_is_an_error_naming_it(tiny_config, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _run_clm().main(["--config_name", tiny_config, "--output_dir", str(tmp_path / "o"),
                         "--per_device_batch_size", "4"])
    assert exc.value.code == 2
    assert "--per_device_batch_size" in capsys.readouterr().err


def test_non_empty_output_dir_needs_overwrite(tiny_config, tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit, match="--overwrite_output_dir"):
        _run_clm().main(["--config_name", tiny_config, "--output_dir", str(tmp_path)])


def test_dataset_name_without_datasets_is_a_clear_error(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # a machine without it (make install installs it)
    with pytest.raises(SystemExit) as ended:
        _run_clm().main(["--config_name", tiny_config, "--output_dir", str(tmp_path / "o"),
                         "--dataset_name", "wikitext", "--dataset_config_name", "wikitext-2-raw-v1"])
    assert ended.value.code == 2
    assert "--dataset_name wikitext needs the `datasets` package" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_blog_flags_parse(tiny_config, tmp_path):
    from xla_fsdp.train.args import parse_args
    args = parse_args([
        "--num_train_epochs", "1", "--dataset_name", "wikitext", "--dataset_config_name",
        "wikitext-2-raw-v1", "--per_device_train_batch_size", "32", "--per_device_eval_batch_size",
        "32", "--do_train", "--do_eval", "--output_dir", str(tmp_path), "--overwrite_output_dir",
        "--config_name", tiny_config, "--cache_dir", "/tmp", "--tokenizer_name", "gpt2",
        "--block_size", "1024", "--optim", "adafactor", "--adafactor", "true", "--save_strategy",
        "no", "--logging_strategy", "no", "--fsdp", "full_shard auto_wrap"])
    assert args.optim == "adafactor" and args.do_train and args.do_eval
    assert args.sharding_strategy == "FULL_SHARD" and args.auto_wrap
    assert args.learning_rate == 5e-5 and args.num_train_epochs == 1.0   # HF defaults with a dataset
    assert parse_args(["--config_name", tiny_config, "--output_dir", "o",
                       "--fsdp", "hybrid_shard"]).sharding_strategy == "HYBRID_SHARD"


def test_bad_fsdp_option_names_it(tiny_config):
    from xla_fsdp.train.args import parse_args
    with pytest.raises(SystemExit, match="offload"):
        parse_args(["--config_name", tiny_config, "--output_dir", "o", "--fsdp", "full_shard offload"])


def test_engine_selection(monkeypatch):
    from xla_fsdp.config import load_fsdp_config
    from xla_fsdp.train.model import selected_engine
    for name in ("XLA_FSDP_ENGINE", "XLA_USE_SPMD"):
        monkeypatch.delenv(name, raising=False)
    v1 = load_fsdp_config({"xla": True})
    v2 = load_fsdp_config({"xla": True, "xla_fsdp_v2": True})
    assert selected_engine(None) == "collectives" and selected_engine(v1) == "collectives"
    assert selected_engine(v2) == "spmd"
    # the variable that once chose the engine is refused by name, with the fsdp_config key instead
    monkeypatch.setenv("XLA_FSDP_ENGINE", "spmd")
    with pytest.raises(SystemExit, match="XLA_FSDP_ENGINE is no longer read.*xla_fsdp_v2"):
        selected_engine(v1)


def test_runtime_selection(monkeypatch):
    from xla_fsdp.train.model import single_controller
    for name in ("XLA_FSDP_RUNTIME", "XLA_USE_SPMD"):
        monkeypatch.delenv(name, raising=False)
    assert not single_controller("collectives") and single_controller("spmd")
    monkeypatch.setenv("XLA_FSDP_RUNTIME", "single_controller")  # what the launcher exports
    assert single_controller("collectives")
    monkeypatch.setenv("XLA_FSDP_RUNTIME", "single")
    with pytest.raises(SystemExit, match="XLA_FSDP_RUNTIME"):
        single_controller("collectives")
    monkeypatch.delenv("XLA_FSDP_RUNTIME")
    monkeypatch.setenv("XLA_USE_SPMD", "1")  # torch_xla's own switch
    assert single_controller("collectives")


def test_fsdp_flag_becomes_engine_keywords(tiny_config):
    from xla_fsdp.train.args import parse_args
    from xla_fsdp.train.model import engine_kwargs

    def kwargs(fsdp):
        return engine_kwargs(parse_args(["--config_name", tiny_config, "--output_dir", "o",
                                         "--fsdp", fsdp]), None)
    assert kwargs("full_shard") == {}                       # the engine's default strategy
    assert kwargs("shard_grad_op") == {"sharding_strategy": "SHARD_GRAD_OP"}
    policy = kwargs("full_shard auto_wrap")["auto_wrap_policy"]
    assert policy.keywords["transformer_layer_cls"] == {"GPT2Block"}


# -m slow: in the default run, run_clm's periodic saves (tests/test_gcs_emulator.py, 4 devices), a job killed
# while a checkpoint is written (tests/test_async_saves.py) and the same command resuming the uninterrupted
# losses (tests/test_preemption.py) are each covered
@pytest.mark.slow
def test_preempted_job_resumes_the_same_loss_curve_and_writes_a_final_model(tiny_config, tmp_path):
    """run_clm with --save_steps: an uninterrupted 8-step run, and the same command killed
    (SIGKILL) once checkpoint-4 is complete and run again: the rerun finds the checkpoint in
    --output_dir (Hugging Face semantics), resumes model, optimizer, LR schedule and data
    position, and logs the losses of the uninterrupted run. Both leave a from_pretrained
    directory and at most --save_total_limit checkpoints."""
    import signal
    import time

    import torch
    from transformers import GPT2LMHeadModel

    flags = ["--config_name", tiny_config, "--do_train", "--fsdp", "full_shard auto_wrap", "--max_steps", "8",
             "--per_device_train_batch_size", "4", "--block_size", "32", "--logging_steps", "1",
             "--warmup_steps", "2", "--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "1"]
    whole, _ = _train(tmp_path / "whole", flags)
    out = tmp_path / "whole" / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-8"]
    model = GPT2LMHeadModel.from_pretrained(str(out))
    ids = torch.arange(32).reshape(1, 32)
    assert torch.isfinite(model(input_ids=ids).logits).all()

    killed = tmp_path / "killed" / "out"
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--output_dir", str(killed)] + flags, env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoint-4" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "the job ended before checkpoint-4"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoint-8").exists(), "killed too late: the job had finished"
    resumed, output = _train(tmp_path / "killed", flags)
    assert "resuming from" in output and "resumed from" in output
    want = dict((s, l) for s, l in whole["losses"])
    got = dict((s, l) for s, l in resumed["losses"])
    assert sorted(got) == [5, 6, 7, 8]
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5), step
    assert (killed / "model.safetensors").exists() and (killed / "config.json").exists()


@pytest.mark.slow  # accumulation parity stays in the default run: tests/test_grad_accumulation.py
def test_gradient_accumulation_equals_the_doubled_batch(tiny_config, tmp_path):
    """--gradient_accumulation_steps 2 over batches of 4 = one batch of 8 per step: same data
    (consecutive batches), same losses and the same LR schedule."""
    common = ["--config_name", tiny_config, "--do_train", "--fsdp", "full_shard auto_wrap", "--max_steps", "6",
              "--block_size", "32", "--logging_steps", "1", "--learning_rate", "3e-3", "--warmup_steps", "2"]
    accumulated, output = _train(tmp_path / "acc", common + ["--per_device_train_batch_size", "4",
                                                             "--gradient_accumulation_steps", "2"])
    doubled, _ = _train(tmp_path / "big", common + ["--per_device_train_batch_size", "8"])
    assert "2 micro-batches each" in output
    assert accumulated["global_batch"] == doubled["global_batch"] == 8 and accumulated["micro_batch"] == 4
    assert accumulated["tokens_per_step"] == doubled["tokens_per_step"]
    got, want = dict(accumulated["losses"]), dict(doubled["losses"])
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_attn_implementation_reaches_the_model_and_eager_keeps_the_attention_matmuls_bf16(tiny_config):
    """`--attn_implementation`: the model gets it, the math is the same (fp32 losses equal), and
    on XLA the reason it exists holds ([Note: eager attention on XLA]): in a bf16 model, torch's
    SDPA computes QK^T and AV in f32 while eager keeps them bf16. If a torch/transformers upgrade
    changes that, this fails and the note (and the README's advice) must be revisited."""
    import re

    import torch
    import torch_xla

    from xla_fsdp.train.args import parse_args
    from xla_fsdp.train.model import build_model, load_config

    assert parse_args(["--config_name", tiny_config, "--output_dir", "o"]).attn_implementation is None
    losses, dots = {}, {}
    for attn in ("eager", "sdpa"):
        args = parse_args(["--config_name", tiny_config, "--output_dir", "o", "--attn_implementation", attn])
        torch.manual_seed(0)
        config = load_config(tiny_config, args.attn_implementation)
        model = build_model(config, False).eval()
        assert model.config._attn_implementation == attn
        ids = torch.randint(0, config.vocab_size, (2, 16))
        with torch.no_grad():
            losses[attn] = model(input_ids=ids, labels=ids).loss.item()
            logits = model.to(torch_xla.device()).to(torch.bfloat16)(input_ids=ids.to(torch_xla.device())).logits
        text = torch_xla._XLAC._get_xla_tensors_hlo([logits])
        dots[attn] = set(re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} dot\(", text))
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-5)
    heads, head_dim = config.n_head, config.n_embd // config.n_head
    scores, context = f"[{2 * heads},16,16]", f"[{2 * heads},16,{head_dim}]"
    assert {"bf16" + scores, "bf16" + context} <= dots["eager"], dots["eager"]
    assert {"f32" + scores, "f32" + context} <= dots["sdpa"], dots["sdpa"]
    assert not any(d.startswith("f32[") for d in dots["eager"]), dots["eager"]


@pytest.mark.slow
def test_scan_layers_through_the_launcher_logs_the_unscanned_losses(tiny_config, tmp_path):
    """`"scan_layers": true` in the GSPMD config, as a user runs it: the same losses as without."""
    plain_config = TINY_FSDP_CONFIG.replace("tiny_cpu", "tiny_cpu_v2")
    scan_config = tmp_path / "tiny_cpu_v2_scan.json"
    scan_config.write_text(json.dumps({**json.load(open(plain_config)), "scan_layers": True}))
    runs = []
    for i, config in enumerate((plain_config, str(scan_config))):
        (tmp_path / str(i)).mkdir()
        report, _ = _train(tmp_path / str(i), [
            "--config_name", tiny_config, "--fsdp", "full_shard", "--fsdp_config", config,
            "--do_train", "--max_steps", "6", "--per_device_train_batch_size", "4",
            "--block_size", "32", "--logging_steps", "2", "--learning_rate", "3e-3"], launcher_cores=2)
        runs.append([loss for _, loss in report["losses"]])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5), runs


# -m slow: stored stacks' checkpoints (per-layer consolidation, loads across stacks both ways, AdamW and
# Adafactor state) in the default run: tests/test_stored_stacks.py; a scanned training job that saves
# per layer and resumes with the same losses, with --optim adafactor: tests/test_hf_trainer.py (v1_scan);
# the scanned collectives engine under the launcher against the unsharded run: tests/test_run_clm_llama.py
@pytest.mark.slow
def test_collectives_scan_through_the_launcher_saves_per_layer_and_resumes(tiny_config, tmp_path):
    """The collectives engine's `"scan_layers": true` as a user runs it (single controller, stored
    stacks: [Note: the collectives engine's stored stacks]): the model it writes has the unscanned
    model's per-layer keys, and a run resumed from its step-3 checkpoint logs the same losses, with
    scan and without. With the recipe's `--optim adafactor`, which runs per layer on the stacks
    ([Note: Adafactor on stored stacks])."""
    from safetensors.torch import load_file

    config = tmp_path / "tiny_cpu_scan.json"
    config.write_text(json.dumps({**json.load(open(TINY_FSDP_CONFIG)), "xla_fsdp_grad_ckpt": True,
                                  "scan_layers": True}))
    common = ["--config_name", tiny_config, "--fsdp", "full_shard", "--fsdp_config", str(config), "--do_train",
              "--max_steps", "6", "--per_device_train_batch_size", "4", "--block_size", "32",
              "--logging_steps", "2", "--learning_rate", "3e-3", "--optim", "adafactor", "--adafactor", "true"]
    (tmp_path / "a").mkdir()
    first, _ = _train(tmp_path / "a", common + ["--save_strategy", "steps", "--save_steps", "3"], launcher_cores=2)
    saved = load_file(str(tmp_path / "a" / "out" / "model.safetensors"))
    assert "transformer.h.1.attn.c_attn.weight" in saved and not any("_scan" in k for k in saved), sorted(saved)
    (tmp_path / "b").mkdir()
    resumed, _ = _train(tmp_path / "b", common + ["--resume_from_checkpoint",
                                                  str(tmp_path / "a" / "out" / "checkpoint-3")], launcher_cores=2)
    assert resumed["losses"] == [step for step in first["losses"] if step[0] > 3], (first["losses"], resumed["losses"])
    # the same checkpoint resumed without scan ([Note: loading across stored stacks]): per-layer
    # parameters and Adafactor's state from the stacks (the column factor and RMS per layer), the same losses
    plain = tmp_path / "tiny_cpu_plain.json"
    plain.write_text(json.dumps({**json.load(open(TINY_FSDP_CONFIG)), "xla_fsdp_grad_ckpt": True}))
    (tmp_path / "c").mkdir()
    unscanned, _ = _train(tmp_path / "c", [*common[:5], str(plain), *common[6:], "--resume_from_checkpoint",
                                           str(tmp_path / "a" / "out" / "checkpoint-3")], launcher_cores=2)
    assert [s for s, _ in unscanned["losses"]] == [s for s, _ in resumed["losses"]]
    assert [l for _, l in unscanned["losses"]] == pytest.approx([l for _, l in resumed["losses"]], rel=1e-5)
