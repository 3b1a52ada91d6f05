"""A local Google Cloud Storage emulator for tests: the `gcs_bucket` fixture.

It starts `gcp-storage-emulator` (requirements-test.txt) in this process on a free
loopback port (127.0.0.1 only, in memory), creates one bucket, and points gcsfs at it
for this process and every child it starts (STORAGE_EMULATOR_HOST, anonymous token);
it stops the server at the end. Without the emulator or gcsfs installed, the tests
that use it skip, naming the package.

`requests()` counts the requests the emulator serves, by kind, with the bytes of
object reads (what a test of the number of round trips checks).

`hold_upload(name_suffix)` makes the emulator hang the upload of a matching object
until released and then drop it: a job can be SIGKILLed in the middle of a save,
deterministically.
"""
import collections
import contextlib
import importlib.util
import os
import sys
import threading
import uuid

import pytest

from common.gcs_requests import free_port, observe_requests  # bench/common: bench/bucket_checkpoint_cost.py counts them too

BUCKET = "xla-fsdp-test"


class Emulator:
    def __init__(self, server, port):
        self.server, self.port = server, port
        self.url = f"gs://{BUCKET}"
        # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is left alone on purpose: xla_fsdp's storage.py must
        # pick gcsfs's JSON-API class by itself under STORAGE_EMULATOR_HOST (else ~40 s stalls)
        self.env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "FSSPEC_GS_TOKEN": "anon"}

    def fresh(self, name="run") -> str:
        """A new, empty prefix in the bucket."""
        return f"{self.url}/{name}-{uuid.uuid4().hex[:8]}"

    def fs(self):
        from xla_fsdp.checkpoint import storage

        return storage.storage_for(self.url).fs

    def objects(self, url: str):
        """Every object under `url`, as paths relative to it."""
        fs = self.fs()
        fs.invalidate_cache()
        root = url.split("://", 1)[1].rstrip("/") + "/"
        return sorted(p[len(root):] for p in fs.find(root))

    @contextlib.contextmanager
    def requests(self):
        """A Counter of the requests served inside the block: "read" (object data), "upload",
        "list", "delete", "metadata", and "read_bytes" (object data sent)."""
        from gcp_storage_emulator import server

        counts, lock = collections.Counter(), threading.Lock()

        def record(handler, kind, seconds, sent):
            with lock:
                counts[kind] += 1
                if kind == "read":
                    counts["read_bytes"] += sent

        undo = observe_requests(server.RequestHandler, record)
        try:
            yield counts
        finally:
            undo()

    @contextlib.contextmanager
    def hold_upload(self, suffix: str):
        """Hang the upload of the first object whose name ends with `suffix`; yields an
        Event set once it hangs. On exit the held upload is dropped (never stored)."""
        storage = self.server._storage
        real = storage.create_file
        held, release = threading.Event(), threading.Event()

        def create_file(bucket_name, file_name, *args, **kwargs):
            if file_name.endswith(suffix) and not held.is_set():
                held.set()
                release.wait()
                raise ConnectionAbortedError(f"{file_name}: dropped by the test (the job was killed)")
            return real(bucket_name, file_name, *args, **kwargs)

        storage.create_file = create_file
        try:
            yield held
        finally:
            release.set()
            storage.create_file = real


def _quiet_disconnects(handle_error):
    """The server prints a traceback for every client that hung up (a SIGKILLed job, gcsfs
    closing its session); other errors still print."""
    def handle(request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            handle_error(request, client_address)
    return handle


@pytest.fixture(scope="session")
def gcs_emulator():
    for module, package in (("gcp_storage_emulator", "gcp-storage-emulator"), ("gcsfs", "gcsfs")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the GCS emulator tests need {package}: pip install -r requirements-test.txt")
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    server._api._httpd.handle_error = _quiet_disconnects(server._api._httpd.handle_error)
    emulator = Emulator(server, port)
    saved = {k: os.environ.get(k) for k in emulator.env}
    os.environ.update(emulator.env)
    import fsspec.config

    fsspec.config.set_conf_env(fsspec.config.conf)  # FSSPEC_GS_TOKEN for this process too
    try:
        yield emulator
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fsspec.config.conf.get("gs", {}).pop("token", None)


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh gs:// prefix in the emulator's bucket."""
    return gcs_emulator.fresh()
