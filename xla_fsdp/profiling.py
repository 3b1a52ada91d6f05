"""Profiles of chosen training steps: torch_xla's profiler trace (TensorBoard's profile plugin and xprof read it) of
steps A to B, for run_clm (`--profile_steps A-B`) and users' own loops.

    profile = ProfileSteps("out/profile", first=3, last=4)
    for step in range(1, steps + 1):
        profile.before(step)
        train_step(...)
        profile.after(step)      # waits for step B to run before the trace stops

The trace records what runs; it does not change the step's program (no compile is added: tests/test_profiling.py counts
them). On a URL (gs://...) the trace is written to a local folder first and copied there when it stops. `host`: this
host's index, a subfolder `host-<i>` when every host profiles (`all_hosts`); by default only host 0 does."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Optional, Tuple

_RANGE = re.compile(r"^(\d+)-(\d+)$")


def parse_range(text: str) -> Tuple[int, int]:
    """"A-B" (1 <= A <= B) -> (A, B); ValueError naming the form otherwise."""
    got = _RANGE.match(text.strip())
    if not got or not 1 <= int(got.group(1)) <= int(got.group(2)):
        raise ValueError(f"{text!r}: give the first and last step to profile as A-B with 1 <= A <= B, e.g. 3-4")
    return int(got.group(1)), int(got.group(2))


class ProfileSteps:
    """Start torch_xla's profiler trace before step `first`, stop it after step `last`."""

    def __init__(self, folder: str, first: int, last: int, host: int = 0, all_hosts: bool = False, say=print):
        if not 1 <= first <= last:
            raise ValueError(f"first={first}, last={last}: give 1 <= first <= last")
        self.first, self.last, self.say = first, last, say
        self.active = all_hosts or host == 0
        self.folder = os.path.join(folder, f"host-{host}") if all_hosts else folder
        self._local: Optional[str] = None
        self.done = False

    def before(self, step: int) -> None:
        if not self.active or step != self.first or self._local is not None or self.done:
            return
        import torch_xla.debug.profiler as xp

        from xla_fsdp.checkpoint.filesystems import is_url

        self._local = tempfile.mkdtemp(prefix="xla_fsdp_profile_") if is_url(self.folder) else self.folder
        os.makedirs(self._local, exist_ok=True)
        xp.start_trace(self._local)

    def after(self, step: int) -> None:
        if self._local is None or step != self.last:
            return
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.profiler as xp

        xm.wait_device_ops()  # the steps have run, so the trace holds them
        xp.stop_trace()
        if self._local != self.folder:
            _upload(self._local, self.folder)
            shutil.rmtree(self._local, ignore_errors=True)
        self._local, self.done = None, True
        self.say(f"profile of steps {self.first}-{self.last} written to {self.folder} "
                 f"(tensorboard --logdir {self.folder}: the Profile tab)")


def of_run_clm(args, host: int, say) -> Optional[ProfileSteps]:
    """run_clm's --profile_steps (parsed to (A, B)) into OUTPUT_DIR/profile, or None without it."""
    if args.profile_steps is None:
        return None
    return ProfileSteps(os.path.join(args.output_dir, "profile"), *args.profile_steps, host=host,
                        all_hosts=args.profile_all_hosts, say=say)


def _upload(local: str, url: str) -> None:
    from xla_fsdp.checkpoint import storage

    st = storage.storage_for(url)
    for folder, _, files in os.walk(local):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                st.write_bytes(st.join(url, *os.path.relpath(path, local).split(os.sep)), f.read())
