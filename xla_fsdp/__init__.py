"""xla_fsdp: fully sharded data parallel training for PyTorch/XLA.

Public entry points: `XlaFullyShardedDataParallel` (alias `FSDP`), the auto-wrap
policies in `xla_fsdp.wrap`, `checkpoint_module`, deferred initialization
(`deferred_init`, `materialize_module`, `is_deferred`), the Hugging Face
`fsdp_config` loader (`xla_fsdp.config.load_fsdp_config`), checkpoints
(`xla_fsdp.checkpoint`; torch_xla's `consolidate_sharded_model_checkpoints`).
"""
from .tpu import libtpu_flags as _libtpu_flags

# On a TPU, before libtpu starts: its async-collective flags, unless the user set LIBTPU_INIT_ARGS
_libtpu_flags.set_defaults()

from .activation_checkpoint import checkpoint_module  # noqa: E402
from .api import FSDP, XlaFullyShardedDataParallel
from .checkpoint import consolidate_sharded_model_checkpoints
from .options import MixedPrecision, ShardingStrategy
from .wrap import (always_wrap_policy, lambda_auto_wrap_policy, size_based_auto_wrap_policy,
                   transformer_auto_wrap_policy)

# the function shadows the submodule of the same name on purpose (torchdistx's call shape);
# import the module as `xla_fsdp.deferred_init` via `from xla_fsdp.deferred_init import ...`
from .deferred_init import deferred_init, is_deferred, materialize_module


__all__ = [
    "XlaFullyShardedDataParallel", "FSDP", "checkpoint_module", "MixedPrecision", "ShardingStrategy",
    "always_wrap_policy", "lambda_auto_wrap_policy", "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy", "deferred_init", "materialize_module", "is_deferred",
    "consolidate_sharded_model_checkpoints",
]
