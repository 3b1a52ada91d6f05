"""The requests a local Google Cloud Storage emulator (gcp-storage-emulator) serves, counted at
its HTTP handler: tests/gcs_emulator.py's `Emulator.requests` and bench/bucket_checkpoint_cost.py."""
import socket
import time


def observe_requests(handler_class, record):
    """Have the emulator's HTTP handler call `record(handler, kind, seconds, bytes_sent)` after
    every request it serves (kind: see `_kind`); returns the function that undoes it."""
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the emulator to listen on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
