"""MFU arithmetic, parameter counting and the chip peak table (xla_fsdp/metrics.py)."""
import math

import pytest

from xla_fsdp import metrics as m

REPO_CONFIGS = "configs/models"


def _config(**kw):
    from transformers import GPT2Config
    base = dict(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=300,
                bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return GPT2Config(**base)


@pytest.mark.parametrize("kw", [
    {},
    {"n_inner": 100},                      # explicit MLP width
    {"tie_word_embeddings": False},        # separate LM head
    {"n_layer": 3, "n_embd": 48, "n_head": 3, "vocab_size": 257},
])
def test_param_count_matches_the_built_model(kw):
    from transformers import GPT2LMHeadModel
    config = _config(**kw)
    model = GPT2LMHeadModel(config)
    assert m.gpt2_num_params(config) == sum(p.numel() for p in model.parameters())


def test_param_count_of_the_2b_recipe_model_by_hand():
    # The "2B" GPT-2 of the 2023 recipe: d=3072, 18 layers, 1024 positions, vocab 50257.
    d, layers, vocab, positions = 3072, 18, 50257, 1024
    per_layer = 12 * d * d + 13 * d          # attention 4d^2+4d, MLP 8d^2+5d, two LayerNorms 4d
    expected = vocab * d + positions * d + layers * per_layer + 2 * d
    assert expected == 2_196_691_968
    config = _config(n_embd=d, n_layer=layers, n_head=24, n_positions=positions, vocab_size=vocab,
                     bos_token_id=50256, eos_token_id=50256)
    assert m.gpt2_num_params(config) == expected


def test_mfu_formula_by_hand():
    # 1e15 FLOPs in 2 s on 4 chips of 275 TFLOPS: 1e15 / 2 / 4 / 2.75e14 = 0.4545...
    assert m.mfu(1e15, 2.0, 4, 275e12) == pytest.approx(1e15 / 2.2e15)
    assert m.tokens_per_step(32, 1024) == 32768
    assert m.flops_per_step(1000, 2048) == 6 * 1000 * 2048


def test_attention_term_by_hand():
    base = m.flops_per_step(1000, 2048)
    with_attn = m.flops_per_step(1000, 2048, n_layer=2, n_embd=128, seq_len=128, include_attention=True)
    assert with_attn - base == 12 * 2 * 128 * 128 * 2048
    with pytest.raises(ValueError, match="n_layer, n_embd and seq_len"):
        m.flops_per_step(1000, 2048, include_attention=True)


@pytest.mark.parametrize("args", [(1.0, 0.0, 1, 1.0), (1.0, 1.0, 0, 1.0), (1.0, 1.0, 1, 0.0)])
def test_mfu_rejects_non_positive_inputs(args):
    with pytest.raises(ValueError, match="positive"):
        m.mfu(*args)


def test_blog_2b_on_v4_8_figure():
    """The published 2B figure: 4.191 s/step on a v4-8 (4 chips x 275 TFLOPS), 35.7 % MFU.

    With our parameter count (2,196,691,968) and 1024-token sequences,
    35.7 % corresponds to ~124.9K tokens per step, i.e. a global batch of
    122 sequences. The recipe's own command (32 per device x 4 chips = 128)
    gives 37.5 %; the blog's figure is therefore ~5 % lower than its command
    implies (it matches 128 sequences only with ~2.09B parameters).
    """
    params = 2_196_691_968
    peak = m.TPU_PEAK_TFLOPS["v4"] * 1e12
    tokens_for_figure = 0.357 * 4.191 * 4 * peak / (6 * params)
    assert round(tokens_for_figure / 1024) == 122
    at_122 = m.mfu(m.flops_per_step(params, m.tokens_per_step(122, 1024)), 4.191, 4, peak)
    assert round(100 * at_122, 1) == 35.7
    at_128 = m.mfu(m.flops_per_step(params, m.tokens_per_step(128, 1024)), 4.191, 4, peak)
    assert round(100 * at_128, 1) == 37.5


def test_blog_config_file_if_present():
    import os
    path = os.path.join(os.path.dirname(__file__), "..", REPO_CONFIGS, "gpt2-2b.json")
    if not os.path.exists(path):
        pytest.skip("configs/models/gpt2-2b.json not in this checkout")
    from transformers import GPT2Config
    assert m.gpt2_num_params(GPT2Config.from_json_file(path)) == 2_196_691_968


@pytest.mark.parametrize("kind,gen", [
    ("TPU v4", "v4"), ("v4-8", "v4"), ("v4-512", "v4"),
    ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("v5litepod-16", "v5e"),
    ("TPU v5p", "v5p"), ("TPU v5", "v5p"), ("v5p-8", "v5p"),
    ("TPU v6 lite", "v6e"), ("v6e-8", "v6e"),
    ("CPU", None), ("v3-8", None), ("TPU v2", None),
])
def test_tpu_generation(kind, gen):
    assert m.tpu_generation(kind) == gen


def test_peak_table_values():
    assert m.TPU_PEAK_TFLOPS == {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}


def test_detect_peak_order(monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    assert m.detect_peak("TPU", "TPU v5 lite").flops_per_chip == 197e12
    override = m.detect_peak("TPU", "TPU v4", override_tflops=100.0)
    assert override.flops_per_chip == 100e12 and override.source == "--peak_tflops"
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    assert m.detect_peak("TPU", "").flops_per_chip == 918e12
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v2-8")
    with pytest.raises(ValueError, match="--peak_tflops"):
        m.detect_peak("TPU", "TPU v2")
    with pytest.raises(ValueError, match="GPU"):
        m.detect_peak("GPU")


def test_cpu_peak_is_measured_once_per_process():
    first = m.detect_peak("CPU")
    assert first.flops_per_chip > 1e8            # any real host does > 0.1 GFLOPS fp32
    assert first.flops_per_chip < 1e15           # and no CPU does a PFLOPS
    assert "measured" in first.source
    assert m.detect_peak("CPU") is first


def test_throughput_meter_windows(monkeypatch):
    clock = iter([100.0, 100.0, 103.0, 107.0, 107.0])  # init, restart@2, close@5, close@7, summary@7
    monkeypatch.setattr(m.time, "perf_counter", lambda: next(clock))
    meter = m.ThroughputMeter(tokens_per_step=1000, flops_per_step=6e9, chips=2, peak=m.Peak(1e10, "t"))
    meter.restart(2)
    w = meter.close(5)
    assert w["steps"] == 3 and w["step_time_s"] == pytest.approx(1.0)
    assert w["tokens_per_s"] == pytest.approx(1000.0)
    assert w["mfu"] == pytest.approx(6e9 / 1.0 / 2 / 1e10)
    assert math.isclose(w["mfu"], 0.3)
    w2 = meter.close(7)                       # the next window starts where the last ended
    assert w2["steps"] == 2 and w2["step_time_s"] == pytest.approx(2.0)
    total = meter.summary(7)                  # steps 3..7 after the warm-up restart at 2
    assert total["measured_steps"] == 5 and total["step_time_s"] == pytest.approx(7.0 / 5)


def test_throughput_summary_needs_a_restart():
    meter = m.ThroughputMeter(1, 1.0, 1, m.Peak(1.0, "t"))
    assert meter.summary(10) == {}
