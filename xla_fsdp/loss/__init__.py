"""The causal-LM loss fused with the output projection, chunk by chunk ([Note: fused output loss])."""
from .fused_cross_entropy import fused_linear_cross_entropy, chunk_tokens, shifted_labels  # noqa: F401
from .causal_lm import use_fused_loss, FusedLossCausalLM  # noqa: F401
