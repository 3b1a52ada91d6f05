"""Where checkpoint files live: a local (or mounted) file system, or any fsspec URL; `storage_for(path)` picks one.

A plain path (`out/run`, `/mnt/shared/run`: a disk, NFS or a gcsfuse/Filestore mount alike) is `LocalStorage`, which
keeps the rename commit of [Note: atomic checkpoints] (save.py). A URL `scheme://...` (`gs://`, `s3://`, `file://`,
`memory://`, ...) is `FsspecStorage`, whose saves commit without a rename ([Note: commit without rename], save.py):
object stores have none. A URL's credentials and options are fsspec's own (e.g. Application Default Credentials for
gcsfs, or `FSSPEC_GCS_<OPTION>` environment variables).

Errors: a URL whose file system is not installed (gs:// without gcsfs) is an ImportError naming the package to install;
every failed write is an OSError (an fsspec back end's own exceptions are wrapped), which is what a save turns into
CheckpointWriteError."""
from __future__ import annotations

import contextlib
import functools
import glob as _glob
import io
import os
import shutil

from .filesystems import check_bucket, filesystem_for, is_url  # noqa: F401  (callers use storage.check_bucket)

_RANGE_BYTES = 64 * 2 ** 20  # the most one ranged read asks for ([Note: ranged reads])


def storage_for(path) -> "Storage":
    """The storage that holds `path`: fsspec's for a URL, the local file system otherwise."""
    path = os.fspath(path)
    return _fsspec_storage(path.split("://", 1)[0]) if is_url(path) else LOCAL


class Storage:
    """What checkpoints need of a file system. Paths are strings in the storage's own spelling (a URL keeps its scheme,
    so messages name what the user gave). Each storage has `join`, `abspath`, `exists`, `isfile`, `isdir`, `size`,
    `glob`, `remove(path, missing_ok=True)`, `makedirs(path, exist_ok=True)`, `rmtree(path, ignore_errors=False)`
    (nothing there: nothing to do), `listdir` ([] when there is nothing there), `open_read` (a binary file, seekable,
    with `readinto`; FileNotFoundError when missing) and `open_write`, a context manager whose file is durable when the
    block ends without an exception (flushed and fsynced on a local disk, uploaded on an object store)."""

    renames = False  # whether renaming a directory is atomic (the commit of [Note: atomic checkpoints])

    def sync_dir(self, path: str) -> None:
        """Make a directory's entries durable (local disks; nothing to do elsewhere)."""

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rename atomically")

    # -- on top of those --------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def read_into(self, path: str, offset: int, buf) -> int:
        """Fill the writable buffer `buf` with the bytes of `path` from `offset`; the number of bytes read (fewer when
        the file ends first)."""
        with self.open_read(path) as f:
            f.seek(offset)
            return f.readinto(buf)

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)


class LocalStorage(Storage):
    """The local file system, mounts included: `os` calls, fsynced writes, atomic renames."""

    renames = True
    join = staticmethod(os.path.join)
    abspath = staticmethod(os.path.abspath)
    exists = staticmethod(os.path.exists)
    isfile = staticmethod(os.path.isfile)
    isdir = staticmethod(os.path.isdir)
    size = staticmethod(os.path.getsize)
    rename = staticmethod(os.replace)

    def open_read(self, path):
        return open(path, "rb")

    @contextlib.contextmanager
    def open_write(self, path):
        with open(path, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def listdir(self, path):
        return os.listdir(path) if os.path.isdir(path) else []

    def remove(self, path, missing_ok=True):
        try:
            os.remove(path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self, path, ignore_errors=False):
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=ignore_errors)

    def makedirs(self, path, exist_ok=True):
        os.makedirs(path, exist_ok=exist_ok)

    def glob(self, pattern):
        return sorted(_glob.glob(pattern))

    def sync_dir(self, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


LOCAL = LocalStorage()


class FsspecStorage(Storage):
    """A URL's file system through fsspec (gcsfs for gs://, s3fs for s3://, fsspec's own for file:// and memory://). No
    atomic rename; listings are not cached across calls (other hosts write into the same directories)."""

    def __init__(self, protocol: str):
        self.protocol = protocol
        self.fs = filesystem_for(protocol)

    def join(self, path, *names):
        for name in names:
            path = path.rstrip("/") + "/" + name
        return path

    def abspath(self, path):
        return path

    def open_read(self, path):
        return self.fs.open(path, "rb")

    # [Note: ranged reads] A load reads each tensor (or each host's rows of it) as its own range. Through fs.open every
    # range also costs an object-metadata lookup (gcsfs: a GET and a listing), three requests per range instead of one
    # (bench/bucket_checkpoint_cost.py). A ranged read (fs.cat_file with start/end: one GET with a Range header) needs
    # no metadata; ranges are split into _RANGE_BYTES pieces so the copy out of each response stays small next to the
    # tensor it fills.

    def read_bytes(self, path):
        return self.fs.cat_file(path)

    def read_into(self, path, offset, buf):
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            want = min(_RANGE_BYTES, len(view) - done)
            data = self.fs.cat_file(path, start=offset + done, end=offset + done + want)
            view[done:done + len(data)] = data
            done += len(data)
            if len(data) < want:
                break
        return done

    @contextlib.contextmanager
    def open_write(self, path):
        with self._wrapped("write", path):
            f = self.fs.open(path, "wb")
        try:
            yield _Guarded(f, self, path)
            with self._wrapped("write", path):
                f.flush()
                with contextlib.suppress(AttributeError, io.UnsupportedOperation):  # no file number: nothing to fsync
                    os.fsync(f.fileno())  # fsspec's local files: fsync as LocalStorage does
        except BaseException:
            with contextlib.suppress(Exception):  # what was written is removed by the failed save (no COMPLETE marker)
                f.close()
            raise
        with self._wrapped("write", path):
            f.close()  # an object store commits the upload here

    def _fresh(self, path):
        """`path`, with fsspec's cached listing of it dropped."""
        with contextlib.suppress(Exception):  # a file system without a cache
            self.fs.invalidate_cache(path)
        return path

    def exists(self, path):
        return self.fs.exists(self._fresh(path))

    def isfile(self, path):
        return self.fs.isfile(self._fresh(path))

    def isdir(self, path):
        return self.fs.isdir(self._fresh(path))

    def listdir(self, path):
        if not self.isdir(path):
            return []
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def size(self, path):
        return int(self.fs.size(self._fresh(path)))

    def remove(self, path, missing_ok=True):
        with self._wrapped("remove", path):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                if not missing_ok:
                    raise

    def rmtree(self, path, ignore_errors=False):
        try:
            with self._wrapped("remove", path):
                if self.exists(path):
                    self.fs.rm(path, recursive=True)
        except OSError:
            if not ignore_errors:
                raise

    def makedirs(self, path, exist_ok=True):
        with self._wrapped("create", path):
            if not exist_ok and self.exists(path):
                raise FileExistsError(f"{path} exists")
            self.fs.makedirs(path, exist_ok=True)  # object stores: no directories, nothing to make

    def glob(self, pattern):
        self._fresh(pattern.split("*", 1)[0].rsplit("/", 1)[0])
        return sorted(p if is_url(p) else self.fs.unstrip_protocol(p) for p in self.fs.glob(pattern))

    @contextlib.contextmanager
    def _wrapped(self, what: str, path: str):
        """Failures as OSError naming the URL (fsspec back ends raise their own types)."""
        try:
            yield
        except OSError:
            raise
        except Exception as e:
            raise OSError(f"could not {what} {path}: {type(e).__name__}: {e}") from e


_fsspec_storage = functools.lru_cache(maxsize=None)(FsspecStorage)  # one per protocol


class _Guarded:
    """A file being written whose write errors are OSError naming the URL."""

    def __init__(self, f, storage: "FsspecStorage", path: str):
        self._f, self._storage, self._path = f, storage, path

    def write(self, data) -> int:
        with self._storage._wrapped("write", self._path):
            return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)
