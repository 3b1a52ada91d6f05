"""A transformers causal LM whose loss never builds the whole logits ([Note: fused output loss]).

`use_fused_loss(model)` gives one model instance a forward that, when `labels` are passed, runs the base model (GPT-2's
`transformer`, Llama's `model`), then `fused_linear_cross_entropy` on its last hidden states and the output embedding,
and returns the model's usual output with that loss and `logits=None`: code that reads the logits of a training forward
fails at once instead of reading something else. Without labels the model's own forward runs (logits as usual)."""
from __future__ import annotations

import torch

from xla_fsdp.class_swap import mix_into

from .fused_cross_entropy import fused_linear_cross_entropy

# arguments of the models' forward that the base model does not take
_HEAD_ONLY = ("labels", "logits_to_keep", "num_items_in_batch", "shift_labels", "return_dict")


class FusedLossCausalLM:
    """Mixed into a `*ForCausalLM` / `GPT2LMHeadModel` instance by `use_fused_loss`."""

    def forward(self, *args, labels=None, **kwargs):
        if labels is None:
            return super().forward(*args, **kwargs)
        if args:
            raise TypeError(f"{type(self).__name__} with the fused loss takes keyword arguments only "
                            f"(input_ids=..., labels=...)")
        if kwargs.get("shift_labels") is not None:
            raise ValueError("the fused loss shifts labels itself; pass labels, not shift_labels, or build "
                             "the model without the fused loss (run_clm without --fused_loss)")
        keep = kwargs.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError(f"logits_to_keep={keep!r} with labels: the fused loss covers every position; "
                             f"build the model without the fused loss (run_clm without --fused_loss)")
        num_items = kwargs.get("num_items_in_batch")
        base_kwargs = {k: v for k, v in kwargs.items() if k not in _HEAD_ONLY}
        # use_cache as the caller (or the config) says, as the model's own forward passes it: a cache also keeps
        # transformers' mask code off a per-device read of the position ids
        outputs = self.base_model(**base_kwargs)
        head = self.get_output_embeddings()
        loss = fused_linear_cross_entropy(outputs.last_hidden_state, head.weight, labels,
                                          bias=getattr(head, "bias", None), num_items_in_batch=num_items)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)


def use_fused_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Give `model` (a transformers causal LM, before wrapping) the fused output loss; returns it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(model, "base_model") or model.base_model is model:
        raise TypeError(f"{type(model).__name__}: the fused loss needs a transformers causal LM "
                        f"(a base model and an output embedding)")
    return mix_into(model, FusedLossCausalLM, "")
