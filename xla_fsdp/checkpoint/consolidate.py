"""Offline consolidation: a sharded checkpoint -> one full model file, one tensor at a time.

Needs neither the model's code, nor torch_xla, nor the layout that saved it: each parameter is assembled from the row
ranges the index lists, written and dropped before the next is read, so peak memory is the largest tensor plus the
interpreter. With the Hugging Face config recorded at save time the output is a `save_pretrained` directory
(`config.json` + `model.safetensors`, tied weights stored once) that `from_pretrained` loads; otherwise a
`model.safetensors` alone.

Both the checkpoint and the output directory may be local (or mounted) paths or fsspec URLs
(`gs://bucket/run/checkpoint-500`: needs gcsfs, storage.py); a checkpoint without its COMPLETE marker is refused.

    python -m xla_fsdp.checkpoint consolidate CHECKPOINT_DIR OUT_DIR
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from . import format as fmt
from ..runtime import stored_keys
from . import storage
from .format import CheckpointError
from .restack import layer_shape


def consolidate(checkpoint: str, out_dir: str) -> str:
    """Write the full model of `checkpoint` into `out_dir`; returns the safetensors file's path."""
    src = storage.storage_for(checkpoint)
    storage.check_bucket(checkpoint)  # a missing bucket by name, not as "not a complete checkpoint"
    storage.check_bucket(out_dir)
    checkpoint = src.abspath(checkpoint)
    if not fmt.is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {fmt.COMPLETE} marker)")
    meta = fmt.read_json(src.join(checkpoint, fmt.METADATA), "checkpoint metadata")
    index = fmt.RowIndex(checkpoint, range(meta["world_size"]))
    index.open_all()
    entries = []
    stacked = meta.get("stacked", {})
    last: dict = {}  # the stored stack read last (its layers are written one after another)
    for name, p in meta["params"].items():  # tied parameters once, under their first name
        shape = p["shape"]
        rows = shape[0] if shape else 1
        dtype = fmt.dtype_from_name(p["dtype"])

        def produce(name=name, shape=shape, rows=rows, dtype=dtype):
            out = torch.empty((rows, *shape[1:]), dtype=dtype)
            index.read_rows(f"param/{name}", 0, rows, out=out)
            return out.reshape(shape)

        if name not in stacked:
            entries.append((name, dtype, shape, produce))
            continue
        # scan_layers' stored stack (d0, L, *rest), or (L,): each layer's key ([Note: parameters stored stacked]); the
        # stack is read once for all its layers
        for i, key in enumerate(stacked[name]):
            def layer(i=i, name=name, produce=produce):
                if name not in last:
                    last.clear()
                    last[name] = produce()
                return stored_keys.layer_slice(last[name], i).contiguous()

            entries.append((key, dtype, layer_shape(shape), layer))
    for name, b in meta.get("buffers", {}).items():
        entries.append((name, fmt.dtype_from_name(b["dtype"]), b["shape"],
                        lambda name=name: index.read_rank(f"buffer/{name}", 0)))
    config = src.join(checkpoint, fmt.HF_CONFIG)
    return fmt.write_pretrained(out_dir, entries, src.read_bytes(config) if src.isfile(config) else None)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xla_fsdp.checkpoint",
                                     description="Offline tools for xla_fsdp checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="write the full model of a sharded checkpoint (streamed, "
                                              "one tensor at a time)")
    cons.add_argument("checkpoint", help="a checkpoint directory or URL (e.g. out/checkpoint-500, "
                                          "gs://bucket/run/checkpoint-500)")
    cons.add_argument("out_dir", help="where to write model.safetensors (and config.json for Hugging Face "
                                      "models: a from_pretrained directory); a path or a URL")
    args = parser.parse_args(argv)
    try:
        path = consolidate(args.checkpoint, args.out_dir)
    except (CheckpointError, ImportError, ValueError, FileNotFoundError) as e:  # the URL's file system, bucket
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {path}")
    return 0
