"""`torch.distributed.checkpoint` (DCP) for FSDP2 scripts: storage at local paths and fsspec URLs, and each host's rows
as DCP's chunks on a pod.

[Note: DCP checkpoints of fully_shard models] On one host DCP needs nothing from this package to save and load a
`fully_shard` model: `model.state_dict()` and `optimizer.state_dict()` have the unwrapped model's keys and shapes
([Note: state dicts of the single controller], [Note: optimizer state of the single controller]), so a checkpoint holds
whole tensors and loads at any device count, into an unwrapped model, or through `dcp_to_torch_save`. DCP sees a world
of one and writes one file per save. Loads keep the sharding ([Note: loading into sharded parameters],
[Note: loaded optimizer state keeps the sharding]).

What this file adds is where the files go. For a URL, `dcp.save(state, checkpoint_id=path)` picks fsspec's default file
system class, which stalls for `gs://` under a local emulator (xla_fsdp/checkpoint/filesystems.py) and fails for a
missing bucket only at the first write. `storage_writer(path)` / `storage_reader(path)` give DCP the file system our own
checkpoints use: torch's `FileSystemWriter` / `FileSystemReader` for a plain path (metadata renamed into place last),
its `FsspecWriter` / `FsspecReader` over `filesystems.filesystem_for(scheme)` for a URL, with the bucket checked first.
`is_complete(path)` says whether a save finished. Both writers delete an older save's `.metadata` before any host writes
data (on the coordinator, in `prepare_global_plan`, which every host waits for): a save killed midway over a complete
checkpoint must not leave the old metadata pointing into half-overwritten files.

[Note: DCP across hosts] On a pod one process per host is one DCP rank, and DCP treats a plain tensor as replicated: it
would write each whole tensor from one host, which cannot read the shards on other hosts' chips. So on several hosts the
`StateTensor`s of model and optimizer state dicts answer DCP's checkpoint protocol, as DTensor does, with `HostChunks`:
- saving, each host's chunks are the rows its own devices hold, each row once across hosts
  (`host_shards.pieces_to_write`: [Note: who writes a row]), moved to host memory only when DCP writes them
  ([Note: one tensor in host memory at a time]);
- loading, each host's chunks are the rows its devices need under the current layout (any host or device count). DCP
  reads them into host buffers; the load that follows (`set_state_dict`, `model.load_state_dict`,
  `optimizer.load_state_dict`) builds each global tensor with its parameter's sharding (`host_shards.ShardReader`),
  every host in the same order. Until then the state dict's tensors keep their old values; `full_tensor()` gives the
  loaded ones.
A checkpoint of either kind loads anywhere: one host, several, or a plain CPU model through DCP alone."""
from __future__ import annotations

import os
from typing import Union

import torch

from ..checkpoint.filesystems import check_bucket, filesystem_for, is_url

METADATA = ".metadata"  # DCP writes it last: its presence marks a complete checkpoint


class _ForgetsOldMetadata:
    """A DCP writer that deletes the `.metadata` of an earlier save to its path before any data is written (see the
    module docstring)."""

    def prepare_global_plan(self, plans):
        plans = super().prepare_global_plan(plans)
        if self._metadata_exists():
            self.fs.rm_file(self._get_metadata_path())
        return plans


def _fsspec_classes():
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter

    class OurFileSystem(FileSystem):
        """torch's fsspec file system for DCP, with the file system chosen as our checkpoints choose it."""

        def init_path(self, path, **kwargs):
            self.fs = filesystem_for(os.fspath(path).split("://", 1)[0])
            return path

    class OnOurFileSystem:
        def __init__(self, path, **kwargs):
            super().__init__(path, **kwargs)
            self.fs = OurFileSystem()
            self.path = self.fs.init_path(path)

    class Writer(_ForgetsOldMetadata, OnOurFileSystem, FsspecWriter):
        def __init__(self, path, **kwargs):
            check_bucket(path)
            super().__init__(path, **kwargs)

    class Reader(OnOurFileSystem, FsspecReader):
        pass

    return Writer, Reader


def storage_writer(path: Union[str, os.PathLike], **kwargs):
    """A DCP StorageWriter for `path`: `dcp.save(state, storage_writer=storage_writer(path))`. Keywords go to torch's
    FileSystemWriter / FsspecWriter (e.g. `thread_count`)."""
    if is_url(path):
        return _fsspec_classes()[0](os.fspath(path), **kwargs)
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(_ForgetsOldMetadata, FileSystemWriter):
        pass

    return Writer(path, **kwargs)


def storage_reader(path: Union[str, os.PathLike]):
    """A DCP StorageReader for `path`: `dcp.load(state, storage_reader=storage_reader(path))`."""
    if is_url(path):
        return _fsspec_classes()[1](os.fspath(path))
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


def is_complete(path: Union[str, os.PathLike]) -> bool:
    """Whether a DCP save to `path` finished (its `.metadata` was written)."""
    path = os.fspath(path)
    if is_url(path):
        fs = filesystem_for(path.split("://", 1)[0])
        fs.invalidate_cache()
        return fs.exists(path.rstrip("/") + "/" + METADATA)
    return os.path.exists(os.path.join(path, METADATA))


class HostChunks:
    """DCP's checkpoint protocol for `StateTensor`s on several hosts ([Note: DCP across hosts])."""

    def __init__(self):
        self._view = None

    def view(self):
        if self._view is None:
            from ..runtime.hosts import host_view

            self._view = host_view()
        return self._view

    def active(self) -> bool:
        return self.view().count > 1

    def write_items(self, value, fqn: str) -> list:
        """DCP's write items for the rows of `value` this host writes (none: another host writes them)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        from ..checkpoint.host_shards import pieces_to_write

        pieces = pieces_to_write(fqn, value.source, value.rows, self.view())
        value.dcp = {"write": {}}
        items = []
        for start, stop, produce in pieces:
            chunk = _chunk(value, start, stop)
            value.dcp["write"][chunk.offsets] = (chunk.sizes, produce)
            items.append(WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, size=value.size(),
                                                               properties=TensorProperties.create_from_tensor(value))))
        return items

    def chunk_list(self, value) -> list:
        """The rows of `value` this host's devices hold (in its source's layout), as DCP's chunks; DCP will read them
        into buffers `tensor_shard` hands out."""
        from ..checkpoint.host_shards import device_rows, is_sharded

        view = self.view()
        if value.dim() == 0 or not is_sharded(value.source):
            spans = [(0, value.rows)]  # replicated: every host reads it whole
        else:
            spans = sorted((start, min(stop, value.rows)) for device, (start, stop, _) in
                           zip(view.all_devices, device_rows(value.source)) if view.owns(device) and start < value.rows)
        merged = []
        for start, stop in spans:  # one chunk per run of rows (neighbouring devices, copies once)
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        value.dcp = {"read": {}, "spans": [tuple(s) for s in merged]}
        return [_chunk(value, start, stop) for start, stop in merged]

    def tensor_shard(self, value, index):
        """Saving: the host tensor of the chunk at `index`. Loading: the buffer DCP reads it into."""
        offsets = torch.Size(index.offset)
        if "write" in value.dcp:
            sizes, produce = value.dcp["write"].pop(offsets)
            return produce().to(value.dtype).reshape(sizes)
        buffers = value.dcp["read"]
        if offsets not in buffers:
            start = offsets[0] if len(offsets) else 0
            stop = next(b for a, b in value.dcp["spans"] if a == start)
            buffers[offsets] = torch.empty(_chunk(value, start, stop).sizes, dtype=value.dtype)
        return buffers[offsets]

    def loaded(self, value, like, dtype):
        """The global tensor of `like`'s stored shape and sharding from the rows read into `value`."""
        from ..checkpoint.host_shards import ShardReader
        from ..runtime.hosts import host_group

        view = self.view()
        row_shape = tuple(value.shape[1:])

        def read(start, stop):
            for a, b in value.dcp["spans"]:
                if a <= start and stop <= b:
                    return value.dcp["read"][_chunk(value, a, b).offsets].reshape(b - a, *row_shape)[start - a:stop - a]
            raise ValueError(f"rows {start}..{stop} of a tensor of shape {tuple(value.shape)} were not read by "
                             "dcp.load on this host: load into the model (and optimizer) whose state dict was "
                             "given to dcp.load")
        reader = ShardReader(view, host_group(view))
        return reader.place(like, reader.shards(like, value.rows, read, dtype))


def _chunk(value, start: int, stop: int):
    """DCP's chunk of rows [start, stop) of `value` (a 0-dim value: the whole)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    if value.dim() == 0:
        return ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(()))
    return ChunkStorageMetadata(offsets=torch.Size((start,) + (0,) * (value.dim() - 1)),
                                sizes=torch.Size((stop - start,) + tuple(value.shape[1:])))


def use_host_chunks() -> None:
    """`StateTensor`s answer DCP with this host's rows when there are several hosts (once)."""
    from ..collective_engine.optimizer_state import StateTensor

    if StateTensor.host_chunks is None:
        StateTensor.host_chunks = HostChunks()
