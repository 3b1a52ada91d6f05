"""Knowing that a host of the slice stopped answering: each host's heartbeat through the hosts' store, and agreements
that wait for a silent host at most the host timeout (`environment.HOST_TIMEOUT`, seconds).

[Note: a host that does not answer] The hosts agree through a gloo group ([Note: the hosts' group] in hosts.py). A host
that dies between two agreements leaves the others in the next one: a killed process closes its connections and gloo
fails at once, naming a socket, not the host; a machine that is gone (or frozen) closes nothing, and gloo waits its
timeout, 30 minutes by default. So every agreement first meets in the group's store (the TCPStore its rendezvous
started, served by host 0): each host marks its arrival and waits for the others' marks while their heartbeats go on. A
background thread on every host bumps a counter in the store every few seconds (over its own connection, so a waiting
host never holds it up); a host whose counter has not moved for the host timeout (default 300 s) did not answer, and the
waiting hosts raise `HostLostError` naming it. A host that is alive but late (host 0 writing a large `save_pretrained`
file) keeps beating and is waited for, up to gloo's own 30 minutes. Host 0's death shows as the store failing, and is
reported as host 0's.

The gloo operation that follows the meeting starts only when every host is there (a barrier too: host 0 must not exit
with its store before every host has seen the meeting complete); its timeout is the host timeout as well, so a host that
dies during one is named by its stopped heartbeat within the bound. A TCPStore client's calls have no timeout of their
own and would block forever against a frozen host 0, so they run on a thread of their own that is given up on after the
bound.

Nothing half-written is taken as a checkpoint: a host raises before the agreement that would have committed it, and only
host 0 commits, after every host said its files are written ([Note: atomic checkpoints] in checkpoint/save.py)."""
from __future__ import annotations

import queue
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from xla_fsdp.runtime import environment

ENV_TIMEOUT = environment.HOST_TIMEOUT
DEFAULT_TIMEOUT = 300.0  # seconds a silent host is waited for
LONGEST_WAIT = 1800.0  # a host alive but never arriving: gloo's own default timeout, as before
_PREFIX = "xla_fsdp/hosts/"


def host_timeout() -> float:
    """The host timeout (ENV_TIMEOUT) in seconds (default 300)."""
    raw = environment.get(ENV_TIMEOUT)
    if not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: set it to how many seconds the hosts wait for a host that "
                         f"stopped answering (a positive number; default {DEFAULT_TIMEOUT:g}), or unset it")
    return value


class HostLostError(RuntimeError):
    """A host of the slice did not answer at an agreement; `hosts` are their indices."""

    def __init__(self, hosts: Sequence[int], world: int, rank: int, why: str, timeout: float):
        self.hosts = tuple(hosts)
        who = (f"host {self.hosts[0]}" if len(self.hosts) == 1 else f"hosts {', '.join(map(str, self.hosts))}")
        super().__init__(
            f"{who} of {world} {why}. This host (host {rank}) stops here rather than wait: nothing it was "
            "saving is taken for a checkpoint (a save in progress is left without its COMPLETE marker, as "
            "'<path>.partial' on a file system; loading and resume skip it). Restart the job on every host; "
            f"resume loads the last complete checkpoint. {ENV_TIMEOUT}={timeout:g} (seconds) sets how long a "
            "silent host is waited for")


class _StoreCalls:
    """Store calls on a daemon thread of their own: a TCPStore client's calls have no timeout, so against a frozen store
    host (host 0 stopped, or its machine gone) they would block forever; here they cost `timeout` seconds, and the stuck
    thread does not hold up the process's exit."""

    def __init__(self, store, timeout: float):
        self._store = store
        self._timeout = timeout
        self._calls: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._serve, daemon=True, name="xla_fsdp host store calls").start()

    def _serve(self) -> None:
        while True:
            name, args, box, done = self._calls.get()
            try:
                box.append((True, getattr(self._store, name)(*args)))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            done.set()

    def __call__(self, name: str, *args):
        box: list = []
        done = threading.Event()
        self._calls.put((name, args, box, done))
        if not done.wait(self._timeout):
            raise TimeoutError(f"the store did not answer {name} within {self._timeout:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value


class HostWatch:
    """This host's heartbeat, and the others' arrivals at each agreement, through `store`."""

    def __init__(self, store, rank: int, world: int, timeout: Optional[float] = None):
        self.rank, self.world = rank, world
        self.timeout = host_timeout() if timeout is None else timeout
        self._calls = _StoreCalls(store, self.timeout)
        self._agreement = 0
        self._stop = threading.Event()
        beat_store = store.clone() if hasattr(store, "clone") else store  # a connection of its own
        period = min(5.0, self.timeout / 5)
        threading.Thread(target=self._beat, args=(beat_store, period), daemon=True,
                         name="xla_fsdp host heartbeat").start()

    def close(self) -> None:
        self._stop.set()

    def _beat(self, store, period: float) -> None:
        key = f"{_PREFIX}beat/{self.rank}"
        while not self._stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the store (host 0) is gone: the next agreement reports it
                return
            self._stop.wait(period)

    def lost(self, hosts, why: str) -> HostLostError:
        return HostLostError(hosts, self.world, self.rank, why, self.timeout)

    def _store(self, name: str, *args):
        try:
            return self._calls(name, *args)
        except Exception as e:  # host 0 serves the store: its failing is host 0's
            raise self.lost([0], f"(which serves the hosts' store) did not answer ({type(e).__name__}: {e})") from e

    def meet(self) -> None:
        """Return once every host has reached this agreement; raise `HostLostError` naming the hosts whose heartbeat
        stopped for `timeout` seconds meanwhile."""
        self._agreement += 1
        n = self._agreement
        count, mark = f"{_PREFIX}at/{n}", lambda r: f"{_PREFIX}at/{n}/{r}"
        self._store("set", mark(self.rank), b"1")
        arrived = self._store("add", count, 1)
        beats: Dict[int, Tuple[int, float]] = {}
        start = checked = time.monotonic()
        pause = 0.001
        while arrived < self.world:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)  # prompt when the hosts arrive together, light when one is late
            arrived = self._store("add", count, 0)
            now = time.monotonic()
            if arrived >= self.world or now - checked < 0.5:
                continue
            checked = now  # who is missing, and is each still beating?
            waiting = [r for r in range(self.world) if r != self.rank and not self._store("check", [mark(r)])]
            silent = [r for r in waiting if self._silent_for(r, beats, now) >= self.timeout]
            if silent:
                raise self.lost(silent, f"did not answer for {self.timeout:g} s at an agreement of the hosts (a "
                                        "checkpoint save or load, an export): its heartbeat through the hosts' "
                                        "store stopped (the host or its process died, or it froze)")
            if now - start >= LONGEST_WAIT:
                raise self.lost(waiting, f"did not reach an agreement of the hosts within {LONGEST_WAIT:g} s, "
                                         "though alive (its heartbeat goes on): it hangs or runs other code")
        if n > 1:  # every host passed agreement n-1 to reach n: its keys are read no more
            try:
                self._calls("delete_key", f"{_PREFIX}at/{n - 1}/{self.rank}")
                if self.rank == 0:
                    self._calls("delete_key", f"{_PREFIX}at/{n - 1}")
            except Exception:
                pass

    def _silent_for(self, r: int, beats: Dict[int, Tuple[int, float]], now: float) -> float:
        """Seconds host r's heartbeat has not moved, as seen from here (`beats`: last value, since)."""
        beat = int(self._store("add", f"{_PREFIX}beat/{r}", 0))
        if r not in beats or beats[r][0] != beat:
            beats[r] = (beat, now)
        return now - beats[r][1]

    def silent_hosts(self) -> List[int]:
        """After a failed exchange: the hosts whose heartbeat stays still for `timeout` seconds (watched that long at
        most; [] when every heartbeat goes on)."""
        beats: Dict[int, Tuple[int, float]] = {}
        start = time.monotonic()
        while True:
            now = time.monotonic()
            try:
                silent = [r for r in range(self.world)
                          if r != self.rank and self._silent_for(r, beats, now) >= self.timeout]
            except HostLostError:
                return [0]
            if silent or now - start > self.timeout:
                return silent
            time.sleep(0.5)


def store_of_default_group():
    """The store the default process group was rendezvoused through (host 0's TCPStore)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()
