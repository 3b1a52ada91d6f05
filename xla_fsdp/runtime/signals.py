"""Signals for code that runs off the main thread: torch_xla's spawn runs each replica's function on a thread of its
process ([Note: a replica's signals]).

[Note: a replica's signals] Python runs signal handlers on the main thread only, and only the main thread may install
them. torch_xla's `xmp.spawn` (the launcher's one process per chip) calls the replica's function on a thread per device
of a ProcessPoolExecutor worker, whose main thread waits for those threads. So a job there cannot install a SIGTERM
handler itself. `listen_on_main_thread()`, called while the replica is unpickled (on the worker's main thread:
xla_fsdp.runtime.self_starting's ReplicaCall), installs `deliver`, which hands each signal to the listeners that code on
any thread registered (`listen`), and, with none, ends the process as the default handler would."""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable, List, Sequence

_LISTENERS: List[Callable] = []
LISTENED = (signal.SIGTERM,)


def deliver(signum, frame) -> None:
    """The handler on the main thread: the listeners' to handle, else the default action."""
    listeners = list(_LISTENERS)
    if not listeners:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    for handle in listeners:
        handle(signum, frame)


def listen_on_main_thread(signals: Sequence[int] = LISTENED) -> None:
    """Install `deliver` for `signals` (on the main thread; elsewhere nothing is done)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals:
        if signal.getsignal(sig) in (signal.SIG_DFL, deliver):
            signal.signal(sig, deliver)


def delivered(signals: Sequence[int]) -> bool:
    """Whether `deliver` handles each of `signals` in this process."""
    return all(signal.getsignal(sig) is deliver for sig in signals)


def listen(handle: Callable) -> None:
    _LISTENERS.append(handle)


def stop_listening(handle: Callable) -> None:
    if handle in _LISTENERS:
        _LISTENERS.remove(handle)
