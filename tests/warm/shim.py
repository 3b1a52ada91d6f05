"""`python` for the suite's child processes ([Note: warm interpreters]).

tests/warm/__init__.py writes this file as an executable whose first line runs
the real interpreter with -S -E (no site, no PYTHON* variables: ~20 ms). It
asks a zygote (sockets in XLA_FSDP_TEST_ZYGOTE, taken in turn) to fork a child with this
process's open descriptors, environment, directory and arguments, forwards
signals to it, and exits as it exits: the same code, or the same signal. With
no zygote, or a command line a forked child cannot honour, it execs the real
interpreter, unchanged.
"""
import array
import json
import os
import signal
import socket
import sys

REAL = sys.executable  # the interpreter on the first line


def _real():
    os.execv(REAL, [REAL] + sys.argv[1:])


def main():
    paths = [p for p in os.environ.get("XLA_FSDP_TEST_ZYGOTE", "").split(os.pathsep) if p]
    if not paths:
        _real()
    try:
        path = paths[_turn() % len(paths)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:
        _real()
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if fd != conn.fileno() and _is_open(fd)]
    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    ignored = [int(s) for s in watched if signal.getsignal(s) == signal.SIG_IGN]
    msg = json.dumps({"argv": sys.argv[1:], "argv0": sys.argv[0], "env": dict(os.environ), "cwd": os.getcwd(),
                      "fds": fds, "ignored": ignored}).encode() + b"\n"
    conn.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    reader = conn.makefile("rb")
    first = reader.readline().split()
    if not first or first[0] != b"pid":
        conn.close()
        _real()
    child = int(first[1])

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in watched:
        if sig not in ignored:
            signal.signal(sig, forward)
    end = reader.readline().split()
    if len(end) != 2:
        os._exit(1)
    if end[0] == b"signal":
        sig = int(end[1])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(int(end[1]))


def _turn() -> int:
    """Round robin over the zygotes (each has its own string-hash seed, so consecutive processes, the
    ranks of one job, hash differently, as fresh interpreters would): one appended byte per process."""
    fd = os.open(os.environ["XLA_FSDP_TEST_ZYGOTE"].split(os.pathsep)[0] + ".turns",
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b".")
        return os.lseek(fd, 0, os.SEEK_CUR)  # this write's own end (fstat could see a later one)
    finally:
        os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


main()
