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


# a move of one layer's slice into a host stack, as libtpu 0.0.21 compiles an offloaded scan (shapes shrunk)
_MOVE = """HloModule m, entry_computation_layout={()->bf16[8,2,64,64]{3,2,1,0}}

ENTRY %main () -> bf16[8,2,64,64] {
  %stack = bf16[8,2,64,64]{3,2,1,0:T(8,128)(2,1)SPACE} parameter(0)
  %x = bf16[1,2,64,64]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %dus-start = ((bf16[8,2,64,64]{3,2,1,0:T(8,128)(2,1)SPACE}, bf16[1,2,64,64]{3,2,1,0:T(8,128)(2,1)}, s32[]{:T(128)}, \
s32[]{:T(128)}, s32[]{:T(128)}, s32[]{:T(128)}), bf16[8,2,64,64]{3,2,1,0:T(8,128)(2,1)SPACE}, u32[]{:S(2)}) \
dynamic-update-slice-start(%stack, %x, %i, %i, %i, %i)
  ROOT %dus-done = bf16[8,2,64,64]{3,2,1,0:T(8,128)(2,1)SPACE} dynamic-update-slice-done(%dus-start)
}
"""


@pytest.mark.parametrize("space, on_core", [("S(5)", False), ("", True)])
def test_a_host_move_costs_the_core_nothing(space, on_core):
    """[Note: host transfers in libtpu's program]: a DMA to the host is charged on its PCIe lane, not as HBM work on
    the core (which would read the whole host stack per move: 5.3 s of the 70B's 19.2 s step); an in-HBM one is."""
    from xla_fsdp.tpu import chips, host_transfers, optimized_hlo as oh, step_time

    text = _MOVE.replace("SPACE", space)
    entry = oh.computations(text)["ENTRY"]
    start = next(i for i in entry if i.opcode == "dynamic-update-slice-start")
    assert host_transfers.is_move(start) is not on_core
    seconds, _, moved = step_time._compute_cost(start, {i.name: i.shape for i in entry}, oh.computations(text),
                                                 chips.CHIPS["v6e"])
    assert (seconds > 0 and moved > 0) if on_core else (seconds == 0 and moved == 0)


def test_core_clock_reads_a_loop_body_in_one_trip():
    from types import SimpleNamespace as NS
    body = [NS(name="x", opcode="fusion"), NS(name="y", opcode="fusion")]
    events = [NS(name="x", trip=0, asynchronous=False, end=11.0), NS(name="y", trip=0, asynchronous=False, end=12.5),
              NS(name="x", trip=1, asynchronous=False, end=14.0), NS(name="z", trip=-1, asynchronous=False, end=20.0)]
    assert dcn.core_clock(body, events, trip=0, offset=10.0) == [0.0, 1.0, 2.5]
