"""The lanes the check charges asynchronous transfers on (xla_fsdp/tpu/dcn.py `lane_wait`; [Note: DCN transfers in
libtpu's program], [Note: host transfers in libtpu's program]): a transfer starts when issued and its lane is free,
must end by its done, and a late one delays the core and everything after it."""
from __future__ import annotations

import pytest

from xla_fsdp.tpu import dcn

CLOCK = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the core reaches position i at i seconds


@pytest.mark.parametrize("jobs, wait", [
    ([(0, 2, 1.5, 0)], 0.0),                    # ends at 1.5, needed at 2
    ([(0, 1, 1.5, 0)], 0.5),                    # needed at 1: the core waits 0.5 s
    ([(0, 2, 1.5, 0), (1, 2, 1.0, 0)], 0.5),    # one lane: the second starts at 1.5, ends at 2.5
    ([(0, 2, 1.5, 0), (1, 2, 1.0, 1)], 0.0),    # two lanes (to the host, back): both in time
    ([(0, 1, 1.5, 0), (1, 2, 1.5, 0)], 1.0),    # the first's wait shifts the second's deadline too
    ([(3, -1, 9.0, 0)], 0.0),                   # no done found: nothing waits for it
])
def test_lane_wait(jobs, wait):
    assert dcn.lane_wait(CLOCK, jobs) == pytest.approx(wait)


def test_core_clock_places_a_loop_at_its_last_trip():
    from types import SimpleNamespace as NS
    entry = [NS(name="a", opcode="fusion"), NS(name="w", opcode="while"), NS(name="b", opcode="fusion")]
    events = [NS(name="a", trip=-1, asynchronous=False, end=1.0), NS(name="x", trip=0, asynchronous=False, end=2.0),
              NS(name="x", trip=1, asynchronous=False, end=3.0), NS(name="b", trip=-1, asynchronous=False, end=3.5)]
    assert dcn.core_clock(entry, events) == [0.0, 1.0, 3.0, 3.5]
