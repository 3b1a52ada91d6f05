"""`torch.distributed.checkpoint` (DCP) storage for FSDP2 scripts: local paths and fsspec URLs.

[Note: DCP checkpoints of fully_shard models] DCP needs nothing from this
package to save and load a `fully_shard` model: `model.state_dict()` and
`optimizer.state_dict()` have the unwrapped model's keys and shapes ([Note: state
dicts of the single controller], [Note: optimizer state of the single controller]),
so a checkpoint holds whole tensors, and loads at any device count, into an
unwrapped model, or through `dcp_to_torch_save`. One process drives every chip,
so DCP sees a world of one and writes one file per save. Loads keep the sharding
([Note: loading into sharded parameters], [Note: loaded optimizer state keeps the
sharding]).

What this file adds is where the files go. `dcp.save(state, checkpoint_id=path)`
picks torch's writer from the path; for a URL that is fsspec's default file
system class, which for `gs://` under a local emulator stalls (see
xla_fsdp/checkpoint/filesystems.py) and for a missing bucket fails at the first
write. `storage_writer(path)` / `storage_reader(path)` give DCP the file system
our own checkpoints use: a plain path is torch's `FileSystemWriter` /
`FileSystemReader` (metadata written last, renamed into place: a save killed
midway leaves no `.metadata`); a URL is torch's `FsspecWriter` / `FsspecReader`
over `xla_fsdp.checkpoint.filesystems.filesystem_for(scheme)`, with the bucket
checked before the first write. `is_complete(path)` says whether a save finished.
"""
from __future__ import annotations

import os
from typing import Union

from ..checkpoint.filesystems import check_bucket, filesystem_for, is_url

METADATA = ".metadata"  # DCP writes it last: its presence marks a complete checkpoint


def _fsspec_classes():
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter

    class OurFileSystem(FileSystem):
        """torch's fsspec file system for DCP, with the file system chosen as our checkpoints choose it."""

        def init_path(self, path, **kwargs):
            self.fs = filesystem_for(os.fspath(path).split("://", 1)[0])
            return path

    class Writer(FsspecWriter):
        def __init__(self, path, **kwargs):
            check_bucket(path)
            super().__init__(path, **kwargs)
            self.fs = OurFileSystem()
            self.path = self.fs.init_path(path)

    class Reader(FsspecReader):
        def __init__(self, path, **kwargs):
            super().__init__(path, **kwargs)
            self.fs = OurFileSystem()
            self.path = self.fs.init_path(path)

    return Writer, Reader


def storage_writer(path: Union[str, os.PathLike], **kwargs):
    """A DCP StorageWriter for `path`: `dcp.save(state, storage_writer=storage_writer(path))`.
    Keywords go to torch's FileSystemWriter / FsspecWriter (e.g. `thread_count`)."""
    if is_url(path):
        return _fsspec_classes()[0](os.fspath(path), **kwargs)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, **kwargs)


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
