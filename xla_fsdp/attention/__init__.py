"""Fused attention for the models run_clm trains: torch_xla's Pallas flash-attention kernel
behind transformers' attention interface (`--attn_implementation pallas`); docs/attention.md."""
from xla_fsdp.attention.kernel import NAME, pallas_attention, register, use_mesh
from xla_fsdp.attention.rules import KernelInputError, check_config

__all__ = ["NAME", "pallas_attention", "register", "use_mesh", "check_config", "KernelInputError"]
