"""`consolidate_sharded_model_checkpoints`: torch_xla's per-rank checkpoint flow, for xla_fsdp.

Scripts written for torch_xla's FSDP save, on every rank,
`{"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}`
to `f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth"` and consolidate the files
afterwards. This reads such files written by xla_fsdp (same call shape and
return value as torch_xla's function) and refuses anything else by name. The
files may be local or at an fsspec URL (`gs://bucket/run/final_ckpt`,
storage.py), and so may the output.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from . import storage
from .format import CheckpointError

SHARD_METADATA_FORMAT = "xla_fsdp.shard_metadata/1"


def consolidate_sharded_state_dicts(state_dicts: List[Dict[str, torch.Tensor]],
                                    shard_metadata: Dict) -> "OrderedDict[str, torch.Tensor]":
    """Rank-ordered `model.state_dict()`s and one rank's `get_shard_metadata()` -> the full state dict."""
    if len(state_dicts) != shard_metadata["world_size"]:
        raise CheckpointError(f"expected {shard_metadata['world_size']} rank state dicts, got {len(state_dicts)}")
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
            dtype = buffers[name].get("_orig_dtype")
            value = value.detach().cpu()
            full[name] = value.to(getattr(torch, dtype.replace("torch.", ""))) if dtype else value
        else:  # never pass a shard off as a whole tensor
            raise CheckpointError(f"{name!r} is in the rank state dicts but the shard metadata records it neither "
                                  "as a sharded parameter nor as a buffer; were they saved from the same model?")
    return full


def consolidate_sharded_model_checkpoints(ckpt_prefix: str, ckpt_suffix: str = "*.pth", save_path: str = "",
                                          save_model: bool = True) -> Tuple[Dict[str, torch.Tensor], Optional[str]]:
    """Consolidate the per-rank files `ckpt_prefix + ckpt_suffix` (a glob) into the full model.

    Each file holds {"model": model.state_dict(), "shard_metadata":
    model.get_shard_metadata()}. Returns (full_state_dict, actual_save_path);
    with `save_model` the result is saved as {"model": full_state_dict} to
    `save_path` or `ckpt_prefix + "_consolidated.pth"`.
    """
    pattern = ckpt_prefix + ckpt_suffix
    st = storage.storage_for(pattern)
    paths = st.glob(pattern)
    if not paths:
        raise CheckpointError(f"no checkpoint files match {pattern}")
    loaded = []
    for path in paths:
        try:
            with st.open_read(path) as f:
                ckpt = torch.load(f, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint file is corrupt or truncated: {path} ({e})") from None
        meta = ckpt.get("shard_metadata") if isinstance(ckpt, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != SHARD_METADATA_FORMAT or "model" not in ckpt:
            raise CheckpointError(f"{path} is not a per-rank xla_fsdp checkpoint ({{'model': model.state_dict(), "
                                  "'shard_metadata': model.get_shard_metadata()}} from an xla_fsdp model); files "
                                  "written by torch_xla's own FSDP are consolidated with torch_xla's function")
        loaded.append((meta["rank"], path, ckpt))
    loaded.sort(key=lambda x: x[0])
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
    return full, actual
