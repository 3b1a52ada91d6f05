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
import socket
import sys
import threading
import time
import uuid

import pytest

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


def observe_requests(handler_class, record):
    """Have the emulator's HTTP handler call `record(handler, kind, seconds, bytes_sent)` after
    every request it serves (kind: see `_kind`); returns the function that undoes it. Shared by
    `Emulator.requests` and bench/bucket_checkpoint_cost.py."""
    real = {m: getattr(handler_class, f"do_{m}") for m in ("GET", "POST", "PUT", "PATCH", "DELETE")}
    real_header = handler_class.send_header

    def served(method):
        def do(handler):
            handler._sent_bytes, started = 0, time.perf_counter()
            real[method](handler)
            record(handler, _kind(method, handler.path), time.perf_counter() - started, handler._sent_bytes)
        return do

    def send_header(handler, keyword, value):
        if keyword.lower() == "content-length":
            handler._sent_bytes = getattr(handler, "_sent_bytes", 0) + int(value)
        return real_header(handler, keyword, value)

    for method in real:
        setattr(handler_class, f"do_{method}", served(method))
    handler_class.send_header = send_header

    def undo():
        for method, fn in real.items():
            setattr(handler_class, f"do_{method}", fn)
        handler_class.send_header = real_header
    return undo


def _kind(method: str, path: str) -> str:
    if "/upload/" in path:
        return "upload"
    if method == "DELETE":
        return "delete"
    if "alt=media" in path or path.startswith("/download/"):
        return "read"
    if method == "GET" and path.split("?", 1)[0].rstrip("/").endswith("/o"):
        return "list"
    return "metadata"


def _quiet_disconnects(handle_error):
    """The server prints a traceback for every client that hung up (a SIGKILLed job, gcsfs
    closing its session); other errors still print."""
    def handle(request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            handle_error(request, client_address)
    return handle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator():
    for module, package in (("gcp_storage_emulator", "gcp-storage-emulator"), ("gcsfs", "gcsfs")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the GCS emulator tests need {package}: pip install -r requirements-test.txt")
    from gcp_storage_emulator.server import create_server

    port = _free_port()
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
