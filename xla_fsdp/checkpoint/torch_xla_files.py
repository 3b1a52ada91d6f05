"""Rank state dicts written by torch_xla's own FSDP, rebuilt into the unwrapped model's state dict.

A torch_xla 2.9 `XlaFullyShardedDataParallel` rank saves `model.state_dict()`, whose parameters are shards registered
under one-segment names starting `_fsdp_shard` (their module's prefix before them), with `model.get_shard_metadata()`:

- `shard_info[prefix][shard name]`: `_orig_size` and `_orig_name` (the parameter's path under that FSDP module, wrapper
  segments included);
- `flatten_info[flat name]`: (names, shapes, numels) of the parameters packed into each `flat_param_<i>` under
  `flatten_parameters=True`;
- `buffer_info[key]["_orig_dtype"]`: buffers FSDP cast, to cast back.

The shard's layout follows `shard_param_on_dim_0`: with False every parameter is flattened and padded (to a multiple of
world size x `_shard_size_multiple`) and each rank holds a 1-D slice; with True each rank holds a slice of dim-0 rows,
padded to the world size. The metadata does not record which, so the shard's rank tells: a 1-D shard is a slice of the
flattened parameter (for a 1-D parameter the two layouts are the same), anything else holds rows. Either way the rank
slices concatenate in rank order, and the padding is at the end."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from .format import CheckpointError

SHARD_MARK = "_fsdp_shard"
# module names torch_xla's wrappers add and its own consolidation drops from every key
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_fpw_module")


def is_torch_xla_metadata(meta) -> bool:
    """Whether `meta` is torch_xla's `get_shard_metadata()` (ours carries a "format" key instead)."""
    return isinstance(meta, dict) and "format" not in meta and "shard_info" in meta and "flatten_info" in meta


def buffer_value(value: torch.Tensor, info: Optional[Dict]) -> torch.Tensor:
    """A buffer on the host, cast back to its buffer_info `_orig_dtype` (torch_xla's, and ours since, a torch.dtype;
    ours before, a string)."""
    dtype = (info or {}).get("_orig_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    value = value.detach().cpu()
    return value.to(dtype) if dtype is not None else value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unwrapped(key: str) -> str:
    return ".".join(s for s in key.split(".") if s not in WRAPPER_SEGMENTS)


def _whole_parameter(key: str, shards: List[torch.Tensor], size: torch.Size) -> torch.Tensor:
    if any(s.shape != shards[0].shape for s in shards):
        raise CheckpointError(f"{key!r} has shards of different shapes across ranks "
                              f"({[tuple(s.shape) for s in shards]}); were the files saved by one run?")
    joined = torch.cat([s.detach().cpu() for s in shards])
    if joined.dim() == 1:  # slices of the flattened parameter (shard_param_on_dim_0=False)
        if joined.numel() < size.numel():
            raise CheckpointError(f"{key!r}: the shards hold {joined.numel()} elements, the parameter "
                                  f"{tuple(size)} has {size.numel()}; is a rank's file missing?")
        return joined[: size.numel()].reshape(size).clone()
    if joined.shape[1:] != size[1:] or joined.shape[0] < size[0]:  # dim-0 rows (shard_param_on_dim_0=True)
        raise CheckpointError(f"{key!r}: shards of {tuple(shards[0].shape)} from {len(shards)} ranks cannot "
                              f"hold a parameter of {tuple(size)}")
    return joined[: size[0]].clone()


def consolidate_torch_xla_state_dicts(state_dicts: List[Dict[str, torch.Tensor]],
                                      meta: Dict) -> "OrderedDict[str, torch.Tensor]":
    """Rank-ordered state dicts of torch_xla's FSDP (as many as its world size) and one rank's metadata -> the full
    state dict."""
    buffers = meta.get("buffer_info", {})
    full: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for key, value in state_dicts[0].items():
        segments = key.split(".")
        at = next((i for i, s in enumerate(segments) if s.startswith(SHARD_MARK)), None)
        if at is None:  # a buffer (or a parameter FSDP left whole): every rank holds all of it
            full[key] = buffer_value(value, buffers.get(key))
            continue
        prefix, shard = ".".join(segments[:at]), ".".join(segments[at:])
        info = meta["shard_info"].get(prefix, {}).get(shard)
        if info is None:
            raise CheckpointError(f"{key!r} is a shard the metadata does not describe (no shard_info"
                                  f"[{prefix!r}][{shard!r}]); were the files saved from the same model?")
        whole = _whole_parameter(key, [sd[key] for sd in state_dicts], torch.Size(info["_orig_size"]))
        full[_join(prefix, info["_orig_name"])] = whole
    # flat parameters (flatten_parameters=True) become their parameters, at the end as in torch_xla's result, so the two
    # list their keys in the same order
    for key in [k for k in full if k in meta["flatten_info"]]:
        names, shapes, numels = meta["flatten_info"][key]
        flat, prefix = full.pop(key), key.rpartition(".")[0]
        for name, shape, piece in zip(names, shapes, flat.split(list(numels))):
            full[_join(prefix, name)] = piece.reshape(shape)
    return OrderedDict((_unwrapped(k), v) for k, v in full.items())
