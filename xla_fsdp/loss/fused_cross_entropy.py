"""The causal-LM loss without the whole [tokens, vocab] logits: output projection and cross entropy fused, a chunk of
tokens at a time.

[Note: fused output loss] Hugging Face's causal LMs compute `logits = lm_head(hidden)` for every token, then the loss
casts them to f32: for the 2B GPT-2 at 32 x 1024 tokens per chip that is [32768, 50257], 3.3 GB in bf16 and 6.6 GB in
f32, plus the f32 gradient of the same size in backward, all alive together at the step's peak (the last block's
backward has not started yet). That is memory every kept activation (`checkpoint_all_but_last`) competes with.

`fused_linear_cross_entropy` computes, chunk by chunk of tokens, the chunk's logits (f32), its log-sum-exp and loss, and
right away the chunk's gradient: softmax minus the one-hot target, times the weight (the gradient of the hidden states)
and into an f32 sum over chunks (the gradient of the weight). Only the gradients of the inputs survive into backward,
which scales them by the incoming gradient; no chunk's logits outlive the chunk. The FLOPs are those of the unfused path
(one projection forward, two in backward); the matmuls take the autocast dtype as `nn.Linear` would (the dtype
transformers' own head computes in).

Equal to transformers' `ForCausalLMLoss` (labels shifted inside, -100 ignored, mean over the targets, or sum /
`num_items_in_batch`) up to the order of f32 sums (tests/test_fused_loss.py). The loss is differentiable once (no double
backward), as the gradient is computed in forward.

On TPU it has not paid: where the step's peak is in the backward (2B GPT-2 on v4-8) the loss's buffers are long gone;
on the Llama 3.1 70B (v6e-256, 6 x 8192 per chip, 8 layers) it moves the peak from the loss into the layers' backward,
27.65 -> 26.25 GiB, too little for another sequence, and adds 0.13 s to the step (docs/performance.md). So run_clm keeps
transformers' loss unless `--fused_loss` is given."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from xla_fsdp.runtime.barrier import optimization_barrier

IGNORE_INDEX = -100
# f32 logits per chunk: 512 MiB keeps the transient small against a layer's activations at the job's shapes (2B GPT-2:
# 2,670 tokens of 50,257 classes, 13 chunks of 32,768 tokens per chip)
CHUNK_BYTES = 512 << 20


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's f32 logits take at most `chunk_bytes`."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be positive")
    return max(1, chunk_bytes // (4 * vocab))


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels of the next token at each position, IGNORE_INDEX after the last (as transformers' ForCausalLMLoss shifts
    them)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


# [Note: one chunk at a time] The chunks are independent but for the sums they add to, so a compiler may run them all
# at once: libtpu did, holding every chunk's [vocab, d] weight gradient (the Llama 3.1 70B at 6 x 8192 tokens per chip:
# 47 chunks of 1.96 GB, 95.8 GB asked of v6e's 31.25). On XLA the next chunk's hidden states pass through one
# optimization barrier with the sums so far, so its matmuls start after the previous chunk's ended.
class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, denominator, chunk):
        n, _ = hidden.shape
        grad_hidden = []
        grad_weight = grad_bias = None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            t = targets[start:start + chunk]
            if grad_weight is not None:  # [Note: one chunk at a time]
                h, grad_weight, total = optimization_barrier([h, grad_weight, total])
            logits = torch.matmul(h, weight.t())
            if bias is not None:
                logits = logits + bias
            logits = logits.float()
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, torch.zeros_like(t))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            scale = valid.float() / denominator
            total = total + ((lse - picked) * scale).sum()
            # d loss / d logits = (softmax - onehot) * scale, in the logits' dtype as autograd would
            g = torch.exp(logits - lse.unsqueeze(1))
            g = g - F.one_hot(safe, logits.shape[1]).float()
            g = (g * scale.unsqueeze(1)).to(hidden.dtype if not torch.is_autocast_enabled(hidden.device.type)
                                            else torch.get_autocast_dtype(hidden.device.type))
            grad_hidden.append(torch.matmul(g, weight).to(hidden.dtype))
            gw = torch.matmul(g.t(), h).float()
            grad_weight = gw if grad_weight is None else grad_weight + gw
            if bias is not None:
                gb = g.float().sum(0)
                grad_bias = gb if grad_bias is None else grad_bias + gb
        ctx.save_for_backward(torch.cat(grad_hidden), grad_weight.to(weight.dtype),
                              None if grad_bias is None else grad_bias.to(bias.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return (grad_hidden * grad_output.to(grad_hidden.dtype), grad_weight * grad_output.to(grad_weight.dtype),
                None if grad_bias is None else grad_bias * grad_output.to(grad_bias.dtype), None, None, None)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, num_items_in_batch=None,
                               chunk: Optional[int] = None) -> torch.Tensor:
    """transformers' causal-LM loss of `hidden @ weight.T (+ bias)` against `labels` (unshifted, as passed to the
    model), computed `chunk` tokens at a time ([Note: fused output loss]).

    hidden: [..., d]; weight: [vocab, d]; labels: hidden's leading shape. Mean over the targets that are not -100, or
    their sum / `num_items_in_batch` when given (transformers' convention for gradient accumulation)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"fused loss: hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} "
                         f"disagree; labels must have the hidden states' leading shape")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"fused loss: output weight {tuple(weight.shape)} does not map hidden size "
                         f"{hidden.shape[-1]} to a vocabulary")
    targets = shifted_labels(labels).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        denominator = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=flat.device).float()
    chunk = min(chunk or chunk_tokens(weight.shape[0]), flat.shape[0])
    return _FusedLinearCrossEntropy.apply(flat, weight, bias, targets, denominator, chunk)

