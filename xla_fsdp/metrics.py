"""Throughput and model-FLOPS-utilization arithmetic, and per-chip peaks (TPUs: the chip table).

The MFU definition is the one our users already quote from the 2023 PyTorch/XLA + Hugging Face GPT-2 recipe: 6 FLOPs per
parameter per token (forward + backward), attention ignored unless asked for, divided by step time, chip count and the
chip's dense bf16 peak. Keeping their definition makes our numbers comparable with the published ones."""
from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

from xla_fsdp.runtime import environment
from xla_fsdp.tpu.chips import CHIPS

# Dense bf16 TFLOPS per chip by generation: the chip table (xla_fsdp.tpu.chips, each figure with its source), in the
# unit --peak_tflops takes.
TPU_PEAK_TFLOPS = {generation: chip.peak_bf16_flops / 1e12 for generation, chip in CHIPS.items()}


def gpt2_num_params(config) -> int:
    """Parameters of a `GPT2LMHeadModel` computed from its config alone.

    Deferred (not yet materialized) models have no storage, so counting has to work from shapes; config arithmetic also
    lets the launcher size a model before building it. The LM head is tied to the token embedding (GPT-2 default), so it
    is counted once."""
    d = config.n_embd
    inner = getattr(config, "n_inner", None) or 4 * d
    per_layer = (
        2 * d                      # ln_1
        + d * 3 * d + 3 * d        # attn.c_attn
        + d * d + d                # attn.c_proj
        + 2 * d                    # ln_2
        + d * inner + inner        # mlp.c_fc
        + inner * d + d            # mlp.c_proj
    )
    embeddings = config.vocab_size * d + config.n_positions * d
    untied_head = 0 if getattr(config, "tie_word_embeddings", True) else config.vocab_size * d
    return embeddings + config.n_layer * per_layer + 2 * d + untied_head


def llama_num_params(config) -> int:
    """Parameters of a `LlamaForCausalLM` computed from its config alone.

    Grouped-query attention: k_proj and v_proj are num_key_value_heads * head_dim wide, q_proj and o_proj
    num_attention_heads * head_dim; the SwiGLU MLP has three matrices (gate, up, down); two RMSNorm weights per layer
    and a final one; the LM head is counted unless tied to the embedding (Llama 3: untied)."""
    d, inner = config.hidden_size, config.intermediate_size
    q, kv = _llama_widths(config)
    per_layer = (
        d * q + 2 * d * kv + q * d                      # q, k, v, o projections
        + 3 * d * inner                                 # gate, up, down
        + 2 * d                                         # input and post-attention RMSNorm
    )
    if getattr(config, "attention_bias", False):
        per_layer += q + 2 * kv + d
    if getattr(config, "mlp_bias", False):
        per_layer += 2 * inner + d
    untied_head = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * d
    return config.vocab_size * d + config.num_hidden_layers * per_layer + d + untied_head


def _llama_widths(config):
    """(q, kv): the widths of Llama's query (and output) projections and of its grouped key/value projections."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim


def num_params(config) -> int:
    """Parameters of run_clm's model for `config` (GPT-2 or Llama), from the config alone."""
    if config.model_type == "llama":
        return llama_num_params(config)
    if config.model_type == "gpt2":
        return gpt2_num_params(config)
    raise ValueError(f"no parameter count for model_type {config.model_type!r} (gpt2 and llama have one)")


# [Note: which parameters 6·N counts] GPT-2 keeps the 2023 recipe's N: every parameter, embeddings included, so our
# GPT-2 MFU compares with the published one. For Llama N is the parameters that multiply each token's activations (the
# projections, the SwiGLU matrices and the LM head; not the input embedding, a row lookup, nor the RMSNorm weights):
# MaxText's count (`calculate_tflops_training_per_device`), which its published Llama MFU (and torchprime's) use. The
# attention term (`--mfu_include_attention`, 12·L·(heads·head_dim)·S per token) is not halved for causal masking, as
# MaxText counted it.
def matmul_params(config) -> int:
    """The N of 6·N FLOPs per token for `config`: [Note: which parameters 6·N counts]."""
    if config.model_type != "llama":
        return num_params(config)
    d, inner = config.hidden_size, config.intermediate_size
    q, kv = _llama_widths(config)
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * inner
    return config.num_hidden_layers * per_layer + config.vocab_size * d


def attention_width(config) -> int:
    """heads x head_dim: the width of the QK^T and AV matmuls that 6·N leaves out (n_embd for GPT-2; Llama's grouped
    key/value heads are repeated to all query heads)."""
    return _llama_widths(config)[0] if config.model_type == "llama" else config.n_embd


def tokens_per_step(global_batch: int, seq_len: int) -> int:
    """Tokens one optimizer step consumes across all chips."""
    return global_batch * seq_len


def flops_per_step(num_params: int, tokens: int, *, n_layer: int = 0, n_embd: int = 0, seq_len: int = 0,
                   include_attention: bool = False) -> float:
    """Training FLOPs of one step: 6·N·T, plus 12·L·d·S·T when asked.

    The attention term counts the QK^T and AV matmuls (forward and backward) that 6·N·T leaves out; it matters once
    seq_len is not small against n_embd."""
    flops = 6.0 * num_params * tokens
    if include_attention:
        if not (n_layer and n_embd and seq_len):
            raise ValueError("include_attention=True needs n_layer, n_embd and seq_len; "
                             "pass them from the model config")
        flops += 12.0 * n_layer * n_embd * seq_len * tokens
    return flops


def mfu(step_flops: float, step_time_s: float, chips: int, peak_flops_per_chip: float) -> float:
    """Model FLOPS utilization as a fraction (0.357 means 35.7 %)."""
    if step_time_s <= 0 or chips <= 0 or peak_flops_per_chip <= 0:
        raise ValueError(f"mfu needs positive step time, chips and peak; got "
                         f"step_time_s={step_time_s}, chips={chips}, peak={peak_flops_per_chip}")
    return step_flops / step_time_s / chips / peak_flops_per_chip


def tpu_generation(kind: str) -> str | None:
    """Map a TPU device kind or accelerator type to a `TPU_PEAK_TFLOPS` key.

    Accepts PJRT device kinds ("TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite") and Cloud accelerator types ("v4-8",
    "v5litepod-16", "v5p-8", "v6e-8"). Returns None when the string names no known chip."""
    text = kind.strip().lower()
    m = re.search(r"v(\d)\s*(lite|e|p)?", text)
    if not m:
        return None
    gen, suffix = m.group(1), m.group(2) or ""
    if gen == "4":
        return "v4"
    if gen in ("5", "6") and suffix in ("lite", "e"):
        return f"v{gen}e"
    return "v5p" if gen == "5" else None  # "TPU v5" (no suffix) is how PJRT names v5p


@dataclass(frozen=True)
class Peak:
    """A per-chip peak and where it came from (reported beside every MFU)."""
    flops_per_chip: float
    source: str


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_peak(n: int = 1024, seconds: float = 0.5) -> Peak:
    """Measured fp32 matmul FLOPS of this host, cached per process.

    There is no vendor peak for "an XLA:CPU device"; a timed torch matmul loop is the best dense rate reachable on this
    host, so MFU on CPU reads as "fraction of what a plain matmul gets here". The fastest single matmul counts (not the
    mean), so a burst of load from other processes during the measurement does not lower the peak and inflate MFU."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool and allocator
    best, iters, start = float("inf"), 0, time.perf_counter()
    while iters < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        iters += 1
    return Peak(2.0 * n ** 3 / best, f"measured: fastest of {iters} fp32 {n}x{n} torch matmuls on this host")


def detect_peak(device_type: str, device_kind: str = "", override_tflops: float | None = None) -> Peak:
    """Peak FLOPS per chip for the running device.

    Order: an explicit `--peak_tflops` override; the TPU table keyed by the device kind or `TPU_ACCELERATOR_TYPE`; a
    measured matmul peak on CPU."""
    if override_tflops is not None:
        return Peak(override_tflops * 1e12, "--peak_tflops")
    if device_type.upper() == "TPU":
        for kind in (device_kind, environment.get(environment.TPU_ACCELERATOR_TYPE)):
            gen = tpu_generation(kind) if kind else None
            if gen:
                return Peak(TPU_PEAK_TFLOPS[gen] * 1e12, f"table: TPU {gen} bf16 dense")
        raise ValueError(f"unknown TPU kind {device_kind!r}; pass --peak_tflops "
                         f"(bf16 dense TFLOPS per chip) to compute MFU")
    if device_type.upper() == "CPU":
        return measure_cpu_matmul_peak()
    raise ValueError(f"no peak FLOPS known for device type {device_type!r}; pass --peak_tflops")


class ThroughputMeter:
    """Tokens/s and MFU over windows of steps whose end the caller synced.

    Lazy XLA steps run asynchronously, so only a window closed after a device sync (a loss fetch, or `wait_device_ops`)
    has a true duration."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, chips: int, peak: Peak):
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.chips = chips
        self.peak = peak
        self._start_time = time.perf_counter()
        self._start_step = 0
        self._summary_start: tuple[float, int] | None = None

    def restart(self, step: int) -> None:
        """Open a new window after `step` (already synced); the first call also starts the run summary (so warm-up steps
        before it are excluded)."""
        self._start_time, self._start_step = time.perf_counter(), step
        if self._summary_start is None:
            self._summary_start = (self._start_time, step)

    def _figures(self, elapsed: float, steps: int) -> dict:
        step_time = elapsed / max(steps, 1)
        return {
            "steps": steps,
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "mfu": mfu(self.flops_per_step, step_time, self.chips, self.peak.flops_per_chip),
        }

    def close(self, step: int) -> dict:
        """Close the window at synced `step`; returns its figures and reopens."""
        now = time.perf_counter()
        figures = self._figures(now - self._start_time, step - self._start_step)
        self._start_time, self._start_step = now, step  # windows abut: no time lost between them
        return figures

    def summary(self, step: int) -> dict:
        """Figures from the first `restart` to synced `step`; {} if never restarted."""
        if self._summary_start is None or step <= self._summary_start[1]:
            return {}
        t0, s0 = self._summary_start
        figures = self._figures(time.perf_counter() - t0, step - s0)
        figures["measured_steps"] = figures.pop("steps")
        return figures
