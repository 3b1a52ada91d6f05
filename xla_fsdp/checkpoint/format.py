"""The on-disk format of a checkpoint: file names, the metadata record, tensor files.

A checkpoint is a directory:

    metadata.json                 what was saved: layout, every parameter's full shape and dtype, the optimizer's
                                  class and hyperparameters, the step, library versions (rank 0 writes it)
    shards-rank00003.safetensors  the rows of each tensor that rank 3 holds, unpadded
    index-rank00003.json          which rows of which tensor are in that file, with checksums
    extra-rank00003.pt            rank 3's own state: RNG states, user objects (torch.save)
    hf_config.json                the model's Hugging Face config, when it has one
    COMPLETE                      written last: only a directory holding it is a checkpoint

Every file goes through storage.py (a local or mounted path, or an fsspec URL: `gs://bucket/run/checkpoint-500`); how a
save commits on each is [Note: atomic checkpoints] and [Note: commit without rename] in save.py.

[Note: checkpoint format] Tensors are stored with safetensors, not torch.distributed.checkpoint (DCP). DCP needs a
process group and DTensor or ShardedTensor state dicts; our shards are plain tensors padded on dim 0, one process per
chip on TPU runs no torch.distributed group, and offline consolidation must run with neither. What resharding needs is
to read some rows of a tensor without reading the rest: a safetensors file is a JSON header and raw row-major bytes, so
rows a..b of a tensor are one contiguous byte range, read here straight into the destination tensor (no memory map, no
second copy); it holds no pickled code, and it is the format Hugging Face loads. Each rank writes the rows it owns
(padding rows are never written), so a checkpoint does not depend on the layout that wrote it; `index-rank*.json` says
which rows each file holds, and any layout reads the rows it needs from whichever files hold them."""
from __future__ import annotations

import json
import struct
import zlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import storage
from .storage import Storage

FORMAT = "xla_fsdp.checkpoint/1"
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
HF_CONFIG = "hf_config.json"
PARTIAL_SUFFIX = ".partial"

_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the file or tensor."""


def shard_file(rank: int) -> str:
    return f"shards-rank{rank:05d}.safetensors"


def index_file(rank: int) -> str:
    return f"index-rank{rank:05d}.json"


def extra_file(rank: int) -> str:
    return f"extra-rank{rank:05d}.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    return getattr(torch, name)


def is_complete(path: str) -> bool:
    st = storage.storage_for(path)
    return st.isfile(st.join(path, COMPLETE)) and st.isfile(st.join(path, METADATA))


def remove_checkpoint(path: str, ignore_errors: bool = False) -> None:
    """Remove a checkpoint so that no reader ever takes what is left for one: its COMPLETE marker first, then the rest
    (a crash in between leaves files that are ignored). When the marker cannot be removed, nothing else is."""
    st = storage.storage_for(path)
    try:
        st.remove(st.join(path, COMPLETE))
    except OSError:
        if ignore_errors:
            return
        raise
    st.rmtree(path, ignore_errors=ignore_errors)


# -- writing --------------------------------------------------------------------

def write_json(path: str, value) -> None:
    storage.storage_for(path).write_bytes(path, json.dumps(value, indent=1, sort_keys=True).encode())


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: str, entries: Sequence[Tuple[str, torch.dtype, Sequence[int], Callable[[], torch.Tensor]]],
                      metadata: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """Write a safetensors file one tensor at a time; returns each tensor's CRC32.

    `entries` are (name, dtype, shape, produce): the header is written first from the declared shapes, then each
    `produce()` is called, written and dropped, so at most one tensor is in memory (what streaming consolidation needs).
    A produced tensor that does not match its declaration is an error."""
    header: Dict[str, object] = {}
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    crcs: Dict[str, int] = {}
    with storage.storage_for(path).open_write(path) as f:  # durable once the block ends
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, dtype, shape, produce in entries:
            tensor = produce()
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                                      f"declared {dtype} {tuple(shape)}")
            raw = _raw(tensor.cpu())
            crcs[name] = zlib.crc32(raw)
            f.write(raw)
            del tensor, raw
    return crcs


def write_pretrained(out_dir: str, entries, config_json: Optional[bytes]) -> str:
    """A `save_pretrained` directory: `model.safetensors` of `entries` and, when given, `config.json`; returns the
    safetensors file's path. The file is never seen half written: on a local file system written beside its name and
    renamed; at a URL one upload, which an object store publishes only once complete (fsspec's file:// writes in
    place)."""
    st = storage.storage_for(out_dir)
    st.makedirs(out_dir, exist_ok=True)
    target = st.join(out_dir, "model.safetensors")
    written = target + PARTIAL_SUFFIX if st.renames else target
    write_safetensors(written, entries, metadata={"format": "pt"})
    if st.renames:
        st.rename(written, target)
    if config_json is not None:
        st.write_bytes(st.join(out_dir, "config.json"), config_json)
    return target


# -- reading --------------------------------------------------------------------

def read_json(path: str, what: str):
    try:
        return json.loads(storage.storage_for(path).read_bytes(path))
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} is corrupt: {path} ({e})") from None


class ShardFile:
    """One rank's tensor file: its header parsed, tensors read by row range straight into the caller's memory (no memory
    map: the resident size stays that of what was asked). Errors name the file."""

    def __init__(self, path: str, expected_bytes: int, crcs: Dict[str, int]):
        self.path = path
        self.storage: Storage = storage.storage_for(path)
        try:
            size = self.storage.size(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file is missing: {path}") from None
        if size != expected_bytes:
            raise CheckpointError(f"checkpoint file is truncated or was overwritten: {path} has {size} bytes, "
                                  f"its index says {expected_bytes}")
        try:  # two ranged reads, not an open (storage.py: [Note: ranged reads])
            (length,) = struct.unpack("<Q", self._read(0, 8))
            if length > size - 8:
                raise ValueError(f"header length {length} exceeds the file")
            self.header = json.loads(self._read(8, length))
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint file is corrupt: {path} (unreadable header: {e})") from None
        self.data_start = 8 + length
        end = max((v["data_offsets"][1] for k, v in self.header.items() if k != "__metadata__"), default=0)
        if self.data_start + end != size:
            raise CheckpointError(f"checkpoint file is corrupt: {path} (header says {self.data_start + end} bytes, "
                                  f"the file has {size})")
        self.crcs = crcs

    def _read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self.storage.read_into(self.path, offset, buf)])

    def info(self, key: str) -> Tuple[torch.dtype, List[int], int]:
        entry = self.header.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint file is corrupt: {self.path} has no tensor {key!r}")
        return _BY_NAME[entry["dtype"]], entry["shape"], entry["data_offsets"][0]

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Fill `out` with rows start.. of tensor `key` (all of it for a 0-dim tensor)."""
        dtype, shape, offset = self.info(key)
        whole = start == 0 and list(out.shape) == list(shape)
        row_bytes = out[0].numel() * out.element_size() if out.dim() else 0
        buf = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else None
        at = self.data_start + offset + start * row_bytes
        if buf is not None and self.storage.read_into(self.path, at, buf) != buf.nbytes:
            raise CheckpointError(f"checkpoint file is truncated: {self.path} ends inside {key!r}")
        if whole and buf is not None and zlib.crc32(buf) != self.crcs.get(key, zlib.crc32(buf)):
            raise CheckpointError(f"checkpoint file is corrupt: {self.path}: tensor {key!r} does not match its "
                                  "checksum")


class RowIndex:
    """Where the rows of every saved tensor are: (file, first row, end row) pieces."""

    def __init__(self, path: str, writers: Iterable[int]):
        self.path = path
        # key -> [(rank, start, stop, key in that file)]: a file may hold several pieces of one tensor (an SPMD host's
        # devices hold rows that are not contiguous), stored under "<key>@<start>" with "tensor": key in the index
        self.pieces: Dict[str, List[Tuple[int, int, int, str]]] = {}
        self.per_rank: Dict[str, Dict[int, None]] = {}
        self.files: Dict[int, ShardFile] = {}
        self._index: Dict[int, dict] = {}
        for rank in writers:
            index = read_json(storage.storage_for(path).join(path, index_file(rank)), f"index of rank {rank}")
            self._index[rank] = index
            for file_key, info in index["tensors"].items():
                key = info.get("tensor", file_key)
                if info.get("rows") is None:
                    self.per_rank.setdefault(key, {})[rank] = None
                else:
                    self.pieces.setdefault(key, []).append((rank, info["rows"][0], info["rows"][1], file_key))
        for key in self.pieces:
            self.pieces[key].sort(key=lambda p: p[1])

    def _file(self, rank: int) -> ShardFile:
        if rank not in self.files:
            index = self._index[rank]
            crcs = {k: v["crc32"] for k, v in index["tensors"].items()}
            st = storage.storage_for(self.path)
            self.files[rank] = ShardFile(st.join(self.path, shard_file(rank)), index["bytes"], crcs)
        return self.files[rank]

    def open_all(self) -> None:
        """Open every file (missing, truncated and unreadable files fail here, by name)."""
        for rank in self._index:
            self._file(rank)

    def has(self, key: str) -> bool:
        return key in self.pieces or key in self.per_rank

    def read_rows(self, key: str, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows [start, stop) of the full tensor `key`, read from every file that holds some of them, into `out` when
        given (so a whole tensor is assembled in its final memory)."""
        pieces = self.pieces.get(key, [])
        if not pieces:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {key!r}")
        if out is None:
            dtype, shape, _ = self._file(pieces[0][0]).info(pieces[0][3])
            out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        at = start
        for rank, lo, hi, file_key in pieces:
            if hi <= at or lo >= stop:
                continue
            if lo > at:
                break
            end = min(hi, stop)
            self._file(rank).read_into(file_key, at - lo, out[at - start:end - start])
            at = end
            if at >= stop:
                break
        if at < stop:
            raise CheckpointError(f"checkpoint {self.path} has no rows {at}..{stop} of {key!r} "
                                  "(a rank's files are missing or the index is inconsistent)")
        return out

    def read_rank(self, key: str, rank: int) -> torch.Tensor:
        """A per-rank tensor (stored whole by each rank that has it)."""
        f = self._file(rank)
        dtype, shape, _ = f.info(key)
        out = torch.empty(shape, dtype=dtype)
        f.read_into(key, 0, out)
        return out

    def dtype_of(self, key: str) -> torch.dtype:
        pieces = self.pieces.get(key)
        if not pieces:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {key!r}")
        return self._file(pieces[0][0]).info(pieces[0][3])[0]

    def ranks_with(self, key: str) -> List[int]:
        return sorted(self.per_rank.get(key, {}))
