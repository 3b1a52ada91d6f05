"""The documented name, kept for compatibility: the code is in `xla_fsdp.checkpoint.state_dict`."""
from .checkpoint.state_dict import (SHARDED_FORMAT, full_state_dict, load_full_state_dict,  # noqa: F401
                                    load_sharded_state_dict, sharded_state_dict)
