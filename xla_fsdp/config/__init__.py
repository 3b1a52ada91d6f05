"""The Hugging Face `fsdp_config` loader: `load_fsdp_config(path_or_dict)` -> validated `FSDPConfig` ->
`engine_kwargs()` for `XlaFullyShardedDataParallel`.

`schema.py` holds the keys, `XlaFSDPSettings` and the checks on single values; `fsdp_config.py` reading a file, the
checks across keys and the engine keywords."""
from .fsdp_config import FSDPConfig, checkpointed_wrapper, load_fsdp_config
from .schema import ENGINE_KEYWORDS, SPMD_ENGINE_KEYWORDS, FSDPConfigError, XlaFSDPSettings

__all__ = ["ENGINE_KEYWORDS", "SPMD_ENGINE_KEYWORDS", "FSDPConfig", "FSDPConfigError", "XlaFSDPSettings",
           "checkpointed_wrapper", "load_fsdp_config"]
