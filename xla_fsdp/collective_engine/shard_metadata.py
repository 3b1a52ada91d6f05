"""`model.get_shard_metadata()`: how this rank's `model.state_dict()` is sharded.

The record torch_xla's FSDP scripts save next to each rank's state dict
(`{"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}`),
read back by `xla_fsdp.consolidate_sharded_model_checkpoints`. Its keys are
our own: state-dict keys here are the unwrapped model's, not torch_xla's
`_fsdp_shard` names, so torch_xla's consolidation cannot read these files and
says so (it fails on the missing "flatten_info") instead of returning shards
as if they were whole parameters.
"""
from __future__ import annotations

from typing import Any, Dict

import torch.nn as nn

FORMAT = "xla_fsdp.shard_metadata/1"


def shard_metadata(root: nn.Module) -> Dict[str, Any]:
    from .. import state_keys as keys  # state-dict keys, not tree names ([Note: state-dict keys])

    comm = root._fsdp_state.group.comm
    layout = comm.layout
    single = comm.is_single_controller
    table = keys.names(root)
    info: Dict[str, Any] = {}
    for prefix, unit in root.named_modules():
        state = getattr(unit, "_fsdp_state", None)
        if state is None:
            continue
        prefix = prefix + "." if prefix else ""
        # the ranks whose shards make up one whole parameter: this unit's, which may differ from
        # the root's (a NO_SHARD unit nested in a FULL_SHARD root, or the reverse)
        group = [0] if single else list(state.group.comm.layout.shard_groups[0])
        for rec in state.group.params:
            names = [keys.key_of(table, prefix + site.fqn) for site in rec.sites]
            for name in names:
                info[name] = {
                    "shape": list(rec.orig_shape), "rows": rec.rows,
                    # one process holds every row in the single-controller runtime, and its
                    # state_dict() has no padding ([Note: state dicts of the single controller])
                    "rows_per_rank": rec.rows if single else rec.rows_per_rank,
                    "tied_to": names[0] if name != names[0] else None,
                    "shard_group": group,
                }
    buffers = keys.buffers(root)
    keys.check_against_state_dict(root, list(info) + list(buffers), "get_shard_metadata()")
    return {
        "format": FORMAT,
        "world_size": 1 if single else layout.world_size,
        "rank": 0 if single else layout.rank,
        "shard_groups": [[0]] if single else [list(g) for g in layout.shard_groups],
        "shard_info": info,
        # a torch.dtype, as torch_xla writes it: its consolidation casts with it, and with a string it
        # failed on the cast ("Invalid device string") before reaching the missing "flatten_info"
        "buffer_info": {name: {"_orig_dtype": b.dtype} for name, b in buffers.items()},
    }
