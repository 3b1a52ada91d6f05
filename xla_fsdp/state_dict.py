"""`xla_fsdp.state_dict`, the name the README documents, kept for compatibility: the code lives in `xla_fsdp.checkpoint.state_dict`."""
from .checkpoint.state_dict import (SHARDED_FORMAT, full_state_dict, load_full_state_dict, load_sharded_state_dict,  # noqa: F401
                                    sharded_state_dict)
