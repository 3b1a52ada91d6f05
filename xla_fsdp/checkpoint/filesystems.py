"""Which fsspec file system serves a URL (`storage.py` holds checkpoint files through it), and whether the bucket a URL
names exists."""
from __future__ import annotations

import os
import re

from xla_fsdp.runtime import environment

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_EXTRAS = {"gs": "xla_fsdp[gcs]", "gcs": "xla_fsdp[gcs]"}  # the extras of setup.py that install a file system
_NO_BUCKETS = {"file", "local", "memory"}  # fsspec file systems whose first path component is no bucket
_CREATE = {"gs": "create it (gcloud storage buckets create gs://{bucket})", "s3": "create it (aws s3 mb s3://{bucket})"}
_CREATE["gcs"] = _CREATE["gs"]


def is_url(path) -> bool:
    return bool(_URL.match(os.fspath(path)))


def check_bucket(path) -> None:
    """Raise FileNotFoundError naming the fix when `path` is a URL into a bucket (gs://B/..., s3://B/...) that does not
    exist; a job checks its output directory before it trains, so a typo costs seconds, not a run whose first save
    fails. Local paths, file:// and memory:// have no buckets."""
    path = os.fspath(path)
    if not is_url(path):
        return
    protocol, rest = path.split("://", 1)
    if protocol in _NO_BUCKETS:
        return
    bucket = rest.split("/", 1)[0]
    if not bucket or _bucket_exists(filesystem_for(protocol), bucket):
        return
    create = _CREATE.get(protocol, "create it").format(bucket=bucket)
    raise FileNotFoundError(f"{path}: bucket {protocol}://{bucket} does not exist (or these credentials "
                            f"cannot see it); {create}, or fix the path")


def _bucket_exists(fs, bucket: str) -> bool:
    """False only when the store says the bucket is not there: a bucket whose metadata these credentials may not read (a
    job needs only object permissions) still counts, as does any other failure, which the first write then reports with
    its own message."""
    try:
        if fs.exists(bucket):
            return True
        fs.invalidate_cache(bucket)
        fs.ls(bucket)  # listing objects: a permission every job that writes there has
        return True
    except FileNotFoundError:
        return False
    except Exception:
        return True


def filesystem_for(protocol: str):
    """fsspec's file system for `protocol` URLs, or an ImportError naming the package to install."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"paths like {protocol}://... need fsspec: pip install fsspec") from None
    from fsspec.registry import known_implementations

    try:
        if protocol in ("gs", "gcs") and environment.get(environment.STORAGE_EMULATOR_HOST):
            return _gcs_for_an_emulator()
        return fsspec.filesystem(protocol)
    except ImportError as e:
        known = known_implementations.get(protocol, {})
        package = known.get("class", "").split(".", 1)[0] or "the package that provides it"
        extra = f" (or pip install {_EXTRAS[protocol]})" if protocol in _EXTRAS else ""
        raise ImportError(f"paths {protocol}://... need {package}, fsspec's file system for "
                          f"{protocol}://, which is not installed: pip install {package}{extra} ({e})") from None
    except ValueError as e:
        raise ValueError(f"no file system for {protocol}:// URLs: fsspec does not know it ({e})") from None


def _gcs_for_an_emulator():
    """gcsfs's JSON-API file system, for STORAGE_EMULATOR_HOST (a local GCS emulator).

    Since 2025.x gcsfs's default class (ExtendedGcsFileSystem, on unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before
    gcsfs is imported) asks the gRPC storage-control API for every bucket's type; an emulator serves only the JSON API,
    so each bucket operation retries that probe for about a minute before falling back. Options still come from fsspec's
    config (FSSPEC_GS_TOKEN=anon, ...)."""
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem()
