"""A SIGTERM becomes a checkpoint: `Preemption` for run_clm and for users' own loops.

[Note: a signal becomes a checkpoint] Spot and preemptible TPU VMs, and every TPU VM at a maintenance event, announce
the end with SIGTERM and a grace period (about 30 s on spot VMs). Inside `with Preemption() as preempted:` the signal
only sets a flag; the loop asks `preempted.agreed()` once per step, at the step boundary, and saves and leaves when it
says so:

    with Preemption() as preempted:
        for step in range(start, steps):
            train_step(...)
            if preempted.agreed():
                save_checkpoint(f"{out}/checkpoint-{step + 1}", model, optimizer, step=step + 1)
                raise SystemExit(EXIT_PREEMPTED)

`agreed()` is every host's answer: on several hosts it is one agreement over the hosts' group (a gloo all-reduce of one
flag, once per step), so a signal that reaches one host only (a maintenance event on one VM) still makes every host save
the same step. A second signal while the save runs does not cut it short: it is said and ignored until the grace period
ends (`grace_s`, 25 s by default, inside Cloud TPU's notice); after that, a signal ends the process as the default
handler would. Outside the `with` block the handlers the process had come back.

The exit status after such a save is EXIT_PREEMPTED (75, EX_TEMPFAIL of sysexits.h: "try again"): the same command
resumes from the checkpoint (run_clm finds the newest complete one in --output_dir, Hugging Face's semantics)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from xla_fsdp.runtime import signals
from xla_fsdp.runtime.self_starting import EXIT_PREEMPTED  # noqa: F401  (75; exported here too)

DEFAULT_GRACE_S = 25.0


class Preemption:
    """Signals turned into a flag the training loop reads at step boundaries (see the note)."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, signals: Sequence[int] = (signal.SIGTERM,),
                 say: Callable[[str], None] = None, hosts=None):
        if not grace_s > 0:
            raise ValueError(f"grace_s={grace_s!r}: give the seconds a save may take after the signal (> 0)")
        self.grace_s = float(grace_s)
        self.signals = tuple(signals)
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._hosts = hosts  # a HostGroup; None: this process's hosts (xla_fsdp.runtime.hosts)
        self._received: Optional[float] = None
        self._signal: Optional[int] = None
        self._before = {}
        self._listening = False
        self._resolved = hosts is not None

    # -- the flag ---------------------------------------------------------------------------------
    @property
    def requested(self) -> bool:
        """Whether this process received one of the signals."""
        return self._received is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self._signal).name if self._signal is not None else ""

    def seconds_left(self) -> float:
        """Of the grace period since the signal (the whole period before one)."""
        return self.grace_s if self._received is None else self.grace_s - (time.monotonic() - self._received)

    def agreed(self) -> bool:
        """Whether any host received the signal: every host gets the same answer at the same step. One agreement over
        the hosts' group when there are several hosts; the local flag otherwise."""
        group = self._group()
        if group is None or group.world == 1:
            return self.requested
        return not group.all_ok(not self.requested)

    def _group(self):
        if not self._resolved and "torch_xla" in sys.modules:  # asked once, after the runtime started
            from xla_fsdp.runtime import hosts

            self._hosts = None if hosts.host_view().count == 1 else hosts.host_group()
            self._resolved = True
        return self._hosts

    # -- the handlers -----------------------------------------------------------------------------
    def __enter__(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            # a replica of torch_xla's spawn runs on a thread ([Note: a replica's signals])
            if not signals.delivered(self.signals):
                raise RuntimeError("Preemption() must be entered on the main thread (Python delivers signals "
                                   "there), or in a replica started by xla_spawn")
            signals.listen(self._handle)
            self._listening = True
            return self
        for sig in self.signals:
            self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._listening:
            signals.stop_listening(self._handle)
            self._listening = False
        for sig, before in self._before.items():
            signal.signal(sig, before)
        self._before.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._received is None:
            self._received, self._signal = time.monotonic(), signum
            self._say(f"xla_fsdp: {name} received: saving a checkpoint at the end of this step "
                      f"(grace period {self.grace_s:g} s), then exiting with status {EXIT_PREEMPTED}")
            return
        if self.seconds_left() > 0:
            self._say(f"xla_fsdp: {name} again: the checkpoint is being saved ({self.seconds_left():.0f} s of the "
                      "grace period left); a signal after that ends the process")
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
