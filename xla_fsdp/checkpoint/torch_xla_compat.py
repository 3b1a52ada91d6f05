"""`consolidate_sharded_model_checkpoints`: torch_xla's per-rank checkpoint flow, for xla_fsdp.

Scripts written for torch_xla's FSDP save, on every rank, `{"model": model.state_dict(), "shard_metadata":
model.get_shard_metadata()}` to `f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth"` and consolidate the files afterwards.
This reads such files written by xla_fsdp, and those written by torch_xla's own FSDP with either `shard_param_on_dim_0`
(torch_xla_files.py), with the call shape, return value and the two log lines of torch_xla's function, and refuses
anything else by name. The files may be local or at an fsspec URL (`gs://bucket/run/final_ckpt`, storage.py), and so may
the output."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from . import storage
from .format import CheckpointError
from ..collective_engine.model_state import SHARD_METADATA_FORMAT
from .torch_xla_files import buffer_value, consolidate_torch_xla_state_dicts, is_torch_xla_metadata


def consolidate_sharded_state_dicts(state_dicts: List[Dict[str, torch.Tensor]],
                                    shard_metadata: Dict) -> "OrderedDict[str, torch.Tensor]":
    """Rank-ordered `model.state_dict()`s and one rank's `get_shard_metadata()` -> the full state dict (of an xla_fsdp
    model, or of torch_xla's FSDP: torch_xla_files.py)."""
    if len(state_dicts) != shard_metadata["world_size"]:
        raise CheckpointError(f"expected {shard_metadata['world_size']} rank state dicts, got {len(state_dicts)}")
    if is_torch_xla_metadata(shard_metadata):
        return consolidate_torch_xla_state_dicts(state_dicts, shard_metadata)
    group = shard_metadata["shard_groups"][0]  # the other groups hold copies of the same shards
    info = shard_metadata["shard_info"]
    buffers = shard_metadata.get("buffer_info", {})
    full: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, value in state_dicts[0].items():
        if name in info:
            p = info[name]
            if p.get("tied_to") and p["tied_to"] in full:
                full[name] = full[p["tied_to"]]
                continue
            owners = p.get("shard_group", group)  # the unit's own group (nested units may differ)
            # a 0-dim parameter is one row (the single-controller runtime saves it unwrapped, shape ())
            shards = [torch.atleast_1d(state_dicts[r][name]) for r in owners]
            for r, shard in zip(owners, shards):
                if shard.shape[0] != p["rows_per_rank"]:
                    raise CheckpointError(f"rank {r}'s {name!r} has {shard.shape[0]} rows, the metadata says "
                                          f"{p['rows_per_rank']} per rank")
            rows = torch.cat([s.detach().cpu() for s in shards])[: p["rows"]]
            full[name] = rows.reshape(p["shape"]).clone()
        elif name in buffers:
            full[name] = buffer_value(value, buffers[name])
        else:  # never pass a shard off as a whole tensor
            raise CheckpointError(f"{name!r} is in the rank state dicts but the shard metadata records it neither "
                                  "as a sharded parameter nor as a buffer; were they saved from the same model?")
    return full


def consolidate_sharded_model_checkpoints(ckpt_prefix: str, ckpt_suffix: str = "*.pth", save_path: str = "",
                                          save_model: bool = True) -> Tuple[Dict[str, torch.Tensor], Optional[str]]:
    """Consolidate the per-rank files `ckpt_prefix + ckpt_suffix` (a glob) into the full model.

    Each file holds {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()} of an xla_fsdp model or
    of torch_xla's FSDP. Returns (full_state_dict, actual_save_path); with `save_model` the result is saved as {"model":
    full_state_dict} to `save_path` or `ckpt_prefix + "_consolidated.pth"`. Prints, as torch_xla's function does, "found
    N checkpoint files in PATTERN" and "saved consolidated model to PATH" (scripts and log readers look for them)."""
    pattern = ckpt_prefix + ckpt_suffix
    st = storage.storage_for(pattern)
    paths = st.glob(pattern)
    if not paths:
        raise CheckpointError(f"no checkpoint files match {pattern}")
    print(f"found {len(paths)} checkpoint files in {pattern}", flush=True)
    loaded = []
    for path in paths:
        try:
            with st.open_read(path) as f:
                ckpt = torch.load(f, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint file is corrupt or truncated: {path} ({e})") from None
        meta = ckpt.get("shard_metadata") if isinstance(ckpt, dict) else None
        ours = isinstance(meta, dict) and meta.get("format") == SHARD_METADATA_FORMAT
        if not (ours or is_torch_xla_metadata(meta)) or "model" not in ckpt:
            raise CheckpointError(f"{path} is not a per-rank FSDP checkpoint ({{'model': model.state_dict(), "
                                  "'shard_metadata': model.get_shard_metadata()}} from an xla_fsdp model or from "
                                  "torch_xla's XlaFullyShardedDataParallel)")
        loaded.append((meta["rank"], path, ckpt))
    loaded.sort(key=lambda x: x[0])
    if len({is_torch_xla_metadata(c["shard_metadata"]) for _, _, c in loaded}) > 1:  # both kinds
        raise CheckpointError(f"{pattern} matches files of both xla_fsdp and torch_xla's FSDP; give a pattern "
                              "that matches one run's files")
    world = loaded[0][2]["shard_metadata"]["world_size"]
    ranks = [r for r, _, _ in loaded]
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise CheckpointError(f"{pattern}: expected the files of ranks 0..{world - 1}, found ranks {ranks}"
                              + (f" (missing {missing})" if missing else " (duplicates or extra files)"))
    full = consolidate_sharded_state_dicts([c["model"] for _, _, c in loaded], loaded[0][2]["shard_metadata"])
    actual = None
    if save_model:
        actual = save_path or ckpt_prefix + "_consolidated.pth"
        with storage.storage_for(actual).open_write(actual) as f:
            torch.save({"model": full}, f)
        print(f"saved consolidated model to {actual}", flush=True)
    return full, actual
