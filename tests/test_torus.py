"""[Note: one reduce-scatter per torus axis]: the stages' groups, and that reducing stage by
stage leaves every device the chunk a flat reduce-scatter would (numpy, every device's data
distinct). The engine runs them in tests/test_single_controller.py (parity at 2x2x2) and
libtpu compiles them in tests/test_tpu_large_slice.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from xla_fsdp.collective_engine import torus
from xla_fsdp.options import CollectiveOptions


def _staged(data: np.ndarray, stages) -> np.ndarray:
    """Run reduce-scatter stages over per-device buffers data[device] -> each device's result."""
    bufs = {d: data[d] for d in range(len(data))}
    for groups, count in stages:
        nxt = {}
        for group in groups:
            total = sum(bufs[d] for d in group)
            for position, d in enumerate(group):
                nxt[d] = np.split(total, count)[position]
        bufs = nxt
    return np.stack([bufs[d] for d in range(len(data))])


@pytest.mark.parametrize("shape", [(2, 2, 4), (2, 2, 1), (4, 4, 4), (2, 4), (1, 2, 2), (16, 16)])
def test_stages_give_each_device_the_flat_reduce_scatters_chunk(shape):
    n = int(np.prod(shape))
    stages = torus.stages(list(range(n)), shape)
    assert [count for _, count in stages] == [s for s in reversed(shape) if s > 1]
    for groups, count in stages:  # every device once per stage, groups along one axis
        assert sorted(d for g in groups for d in g) == list(range(n)) and {len(g) for g in groups} == {count}
    data = np.random.default_rng(0).standard_normal((n, n * 3))
    flat = np.stack(np.split(data.sum(0), n))
    np.testing.assert_allclose(_staged(data, stages), flat, rtol=1e-12, atol=1e-12)


def test_stages_on_v4_32_run_along_z_then_y_then_x():
    stages = torus.stages(list(range(16)), (2, 2, 4))
    assert stages[0] == ([[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]], 4)
    assert stages[1][0][:2] == [[0, 2], [1, 3]] and stages[2][0][:2] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("group,shape,mode", [
    (list(range(8)), (8, 1, 1), "auto"),          # one axis: the flat one is already along it
    (list(range(8)), (2, 2, 2), "flat"),           # turned off
    ([1, 0, 2, 3, 4, 5, 6, 7], (2, 2, 2), "auto"),  # not device-id order
    (list(range(4)), (2, 2, 2), "auto"),           # not the whole slice (hybrid groups)
    (list(range(8)), None, "auto"),                # slice unknown
])
def test_flat_where_stages_are_not_known_to_be_right(group, shape, mode):
    assert torus.stages(group, shape, mode) == []


def test_shape_from_device_coordinates():
    v4_32 = [(x, y, z) for z in range(4) for y in range(2) for x in range(2)]
    assert torus.from_coordinates(v4_32) == (2, 2, 4)
    assert torus.from_coordinates([(0, 0, 0), (0, 0, 0)]) is None  # two cores per chip
    assert torus.from_coordinates([(0, 1, 0), (0, 0, 0)]) is None  # another numbering
    assert torus.from_coordinates([]) is None


def test_a_plane_slice_reduces_along_its_two_axes_and_never_rings_its_reduce_scatters(monkeypatch):
    """[Note: staged on 2-D slices]: v6e-256 (16 x 16) reduce-scatters one 16-chip line at a
    time; the reduce-scatter rings stay on 3-D slices, where they were measured."""
    from xla_fsdp.collective_engine import auto, region_collectives

    monkeypatch.setenv(torus.ENV, "16x16")
    assert torus.slice_shape() == (16, 16) and not torus.three_axes((16, 16))
    stages = torus.stages(list(range(256)), torus.slice_shape())
    assert [count for _, count in stages] == [16, 16]
    assert stages[0][0][0] == list(range(0, 256, 16)) and stages[1][0][0] == list(range(16))
    assert not auto.scatter_rings_apply([list(range(32))], 32, region_collectives._torus_known())
    monkeypatch.setenv(torus.ENV, "4x4x2")  # v4-64
    assert torus.three_axes(torus.slice_shape())
    assert auto.scatter_rings_apply([list(range(32))], 32, region_collectives._torus_known())


@pytest.mark.parametrize("text", ["2x", "axb", "0x2x2", ""])
def test_bad_torus_text_is_refused_by_name(text):
    with pytest.raises(ValueError, match=torus.ENV):
        torus.parse(text)


def test_unknown_stage_mode_is_refused():
    with pytest.raises(ValueError, match="reduce_scatter_stages='rings'"):
        CollectiveOptions(reduce_scatter_stages="rings")
    with pytest.raises(ValueError, match="reduce_scatter_stages"):
        torus.stages([0, 1], (2, 1), "rings")


def test_ring_mode_issues_no_reduce_scatter_stages():
    """"ring" replaces the reduce-scatters altogether ([Note: ring reduce-scatter])."""
    assert CollectiveOptions(reduce_scatter_stages="ring").reduce_scatter_stages == "ring"
    assert torus.stages(list(range(8)), (2, 2, 2), "ring") == []
    assert len(torus.stages(list(range(8)), (2, 2, 2), "auto")) == 3
    assert len(torus.stages(list(range(8)), (2, 2, 2), "axes")) == 3


@pytest.mark.parametrize("shape", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2), (3, 2, 4)])
def test_ring_chunk_orders_give_the_flat_reduce_scatter(shape):
    """Play the rings of ring.py on numpy: each device lines its chunks up by its row of
    `chunk_orders`, and each step adds the next one to what its predecessor on the ring held.
    Device d must end with chunk d of the sum, as the flat reduce-scatter leaves it."""
    from xla_fsdp.collective_engine.ring import chunk_orders, ring_axes

    n = int(np.prod(shape))
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((n, n * 3))  # each device's full gradient, n chunks of 3
    orders = chunk_orders(shape)
    grid = tuple(reversed(shape))  # (Z, Y, X) over device ids, row-major
    out, start = [g for g in grads], 0
    for dim, k, _ in ring_axes(shape):
        lined = [o.reshape(k, -1)[orders[d, start:start + k]] for d, o in enumerate(out)]
        start += k
        held = [line[0] for line in lined]
        for step in range(1, k):
            coords = [np.unravel_index(d, grid) for d in range(n)]
            pred = [np.ravel_multi_index(tuple((c[i] - 1) % grid[i] if i == dim else c[i] for i in range(3)), grid)
                    for c in coords]
            held = [held[pred[d]] + lined[d][step] for d in range(n)]
        out = held
    total = grads.sum(0).reshape(n, -1)
    for d in range(n):
        np.testing.assert_allclose(out[d], total[d], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2), (3, 2, 4)])
def test_ring_gather_orders_give_the_all_gather(shape):
    """ring.py's all-gather played on numpy: each step passes what a device received last to its
    successor; the received pieces, reordered by the device's row of `gather_orders`, must be
    every device's shard in device-id order."""
    from xla_fsdp.collective_engine.ring import gather_orders, ring_axes

    n = int(np.prod(shape))
    shards = np.random.default_rng(1).standard_normal((n, 5))
    orders = gather_orders(shape)
    grid = tuple(reversed(shape))
    coords = [np.unravel_index(d, grid) for d in range(n)]
    out, start = [s for s in shards], 0
    for dim, k, _ in reversed(ring_axes(shape)):
        pred = [np.ravel_multi_index(tuple((c[i] - 1) % grid[i] if i == dim else c[i] for i in range(3)), grid)
                for c in coords]
        received = [[o] for o in out]
        for _ in range(1, k):
            last = [r[-1] for r in received]
            for d in range(n):
                received[d].append(last[pred[d]])
        out = [np.stack(received[d])[orders[d, start:start + k]].reshape(-1) for d in range(n)]
        start += k
    for d in range(n):
        np.testing.assert_array_equal(out[d], shards.reshape(-1))


@pytest.mark.parametrize("gather,scatter,single,possible,tpu,want", [
    ("auto", "auto", True, True, True, ("ring", "ring")),                # the single controller on a TPU
    ("auto", "auto", True, True, False, ("all_gather", "axes")),         # XLA:CPU: what the parity runs test
    ("auto", "auto", True, False, True, ("all_gather", "axes")),         # HYBRID / sharding groups
    ("auto", "auto", False, True, True, ("all_gather", "axes")),         # one process per chip (pinned)
    ("all_gather", "auto", True, True, True, ("all_gather", "axes")),    # no reduce-scatter ring alone
    ("auto", "flat", True, True, True, ("all_gather", "flat")),
    ("auto", "ring", True, True, True, ("ring", "ring")),
    ("ring", "auto", True, True, True, ("ring", "ring")),
    ("all_reduce", "flat", True, True, True, ("all_reduce", "flat")),    # nothing to decide
])
def test_auto_means_rings_only_where_they_apply(gather, scatter, single, possible, tpu, want):
    """[Note: rings by default on a TPU] in collective_engine/auto.py."""
    from xla_fsdp.collective_engine import auto

    got = auto.resolve(CollectiveOptions(all_gather_impl=gather, reduce_scatter_stages=scatter),
                       single_controller=single, rings_possible=possible, on_tpu=tpu)
    assert (got.all_gather_impl, got.reduce_scatter_stages) == want


def test_rings_off_keeps_the_gathers_and_their_budget():
    """XLA_FSDP_RINGS=0 ([Note: rings off for the last GiB]): "auto" keeps the gathers and staged
    reduce-scatters, and libtpu gets their 70% budget; an explicit "ring" still wins; a value it
    cannot read is named."""
    from xla_fsdp.collective_engine import auto
    from xla_fsdp.tpu import libtpu_flags as lf

    off = {lf.RINGS_ENV: "0"}
    assert not lf.rings_enabled(off) and lf.rings_enabled({}) and lf.rings_enabled({lf.RINGS_ENV: "1"})
    got = auto.resolve(CollectiveOptions(), single_controller=True, rings_possible=True, on_tpu=True,
                       rings_enabled=lf.rings_enabled(off))
    assert (got.all_gather_impl, got.reduce_scatter_stages) == ("all_gather", "axes")
    asked = auto.resolve(CollectiveOptions(all_gather_impl="ring"), single_controller=True, rings_possible=True,
                         on_tpu=True, rings_enabled=False)
    assert (asked.all_gather_impl, asked.reduce_scatter_stages) == ("ring", "ring")
    assert lf.for_runtime("single_controller", 8, {}) == lf.SINGLE_CONTROLLER_INIT_ARGS
    assert lf.for_runtime("single_controller", 8, off) == lf.DEFAULT_INIT_ARGS
    env = {"PJRT_DEVICE": "TPU", "XLA_FSDP_RUNTIME": "single_controller", lf.CHIPS_ENV: json.dumps({"chips": 4}), **off}
    assert lf.set_defaults(env) == lf.at_start(lf.DEFAULT_INIT_ARGS)
    with pytest.raises(ValueError, match="XLA_FSDP_RINGS='maybe'.*expected 0"):
        lf.rings_enabled({lf.RINGS_ENV: "maybe"})


def test_rings_apply_to_one_group_of_every_device_in_id_order():
    from xla_fsdp.collective_engine import auto

    assert auto.rings_apply([[0, 1, 2, 3]], 4)
    assert not auto.rings_apply([[0, 1], [2, 3]], 4)  # HYBRID_SHARD's shard groups
    assert not auto.rings_apply([[1, 0, 2, 3]], 4)
    assert not auto.rings_apply([[0]], 1)
    assert auto.rings_apply([list(range(8))], 8)  # v5e-8, v6e-8
    assert not auto.rings_apply([list(range(32))], 32)  # v4-64: the gathers project faster there


@pytest.mark.parametrize("gather,single,pod,tpu,enabled,want", [
    ("auto", True, True, True, True, ("all_gather", "ring")),           # a pod: reduce-scatters ring
    ("all_gather", True, True, True, True, ("all_gather", "ring")),     # gathers asked for: the same
    ("auto", True, True, False, True, ("all_gather", "axes")),          # XLA:CPU
    ("auto", False, True, True, True, ("all_gather", "axes")),          # one process per chip
    ("auto", True, True, True, False, ("all_gather", "axes")),          # XLA_FSDP_RINGS=0
    ("auto", True, False, True, True, ("all_gather", "axes")),          # sharding groups, torus unknown
    ("all_reduce", True, True, True, True, ("all_reduce", "axes")),     # the emulated gather keeps its stages
])
def test_pods_ring_the_reduce_scatters_only(gather, single, pod, tpu, enabled, want):
    """[Note: reduce-scatter rings on pods] in collective_engine/auto.py."""
    from xla_fsdp.collective_engine import auto

    got = auto.resolve(CollectiveOptions(all_gather_impl=gather, reduce_scatter_stages="auto"),
                       single_controller=single, rings_possible=False, on_tpu=tpu, rings_enabled=enabled,
                       scatter_rings_possible=pod)
    assert (got.all_gather_impl, got.reduce_scatter_stages) == want


def test_scatter_rings_apply_to_pods_with_a_known_torus():
    from xla_fsdp.collective_engine import auto

    assert auto.scatter_rings_apply([list(range(32))], 32, torus_known=True)  # v4-64
    assert not auto.scatter_rings_apply([list(range(32))], 32, torus_known=False)  # v5e/v6e, unknown
    assert not auto.scatter_rings_apply([list(range(8))], 8, torus_known=True)  # rings for both there
    assert auto.scatter_rings_apply([list(range(64))], 64, torus_known=True)  # v4-128, measured
    assert not auto.scatter_rings_apply([list(range(128))], 128, torus_known=True)  # v4-256: not measured
    assert not auto.scatter_rings_apply([list(range(16)), list(range(16, 32))], 32, torus_known=True)


def test_rings_under_the_per_chip_budget_say_how_to_get_theirs():
    """A script that turned the single controller on itself (libtpu started with the 70% budget
    xla_fsdp sets for one process per chip) is told how to get the rings' 50%."""
    from xla_fsdp.collective_engine import auto
    from xla_fsdp.tpu import libtpu_flags as lf

    per_chip = {"PJRT_DEVICE": "TPU"}  # what xla_fsdp sets before the runtime is known
    lf.set_defaults(per_chip)
    for started_with in (per_chip[lf.ENV], lf.DEFAULT_INIT_ARGS):  # set by xla_fsdp, or exported as printed
        with pytest.warns(UserWarning, match="XLA_FSDP_RUNTIME=single_controller"):
            assert auto.warn_if_budget_is_not_the_rings({lf.ENV: started_with})
    assert not auto.warn_if_budget_is_not_the_rings({lf.ENV: lf.SINGLE_CONTROLLER_INIT_ARGS})
    assert not auto.warn_if_budget_is_not_the_rings({lf.ENV: lf.at_start(lf.SINGLE_CONTROLLER_INIT_ARGS)})
    assert not auto.warn_if_budget_is_not_the_rings({lf.ENV: "--mine=1"})  # the user's own: theirs


def test_spec_probe_is_as_long_as_the_devices_each_dim_is_split_over():
    """The probe that reads how torch_xla prints a ring's sharding (conversions._spec_text) is
    sized by the mesh axes each dim is split over: 128 elements for v4-256's 8x4x4 rings, where
    a probe of the whole mesh in every dim needed 128**5 floats and the 64B step failed to trace."""
    from types import SimpleNamespace

    from xla_fsdp.collective_engine.conversions import _split_over
    from xla_fsdp.collective_engine.ring import AXES

    mesh = SimpleNamespace(axis_names=AXES, mesh_shape=(8, 4, 4))
    assert [_split_over(mesh, a) for a in AXES + (None, None)] == [8, 4, 4, 1, 1]
    assert _split_over(mesh, ("ring_z", "ring_x")) == 32 and _split_over(mesh, 1) == 4
    unnamed = SimpleNamespace(axis_names=None, mesh_shape=(16, 8))
    assert _split_over(unnamed, 0) == 16 and _split_over(unnamed, (0, 1)) == 128


@pytest.mark.parametrize("shape,slices", [((2, 2, 4), 2), ((16, 16), 2), ((2, 2, 1), 3)])
def test_each_slice_runs_one_slices_stages_in_every_slice_at_once(shape, slices):
    """HSDP over slices (torus.each_slice): every device ends with the chunk a flat reduce-scatter
    over its own slice gives it, and no stage's group leaves a slice."""
    k = int(np.prod(shape))
    stages = torus.each_slice(torus.stages(list(range(k)), shape), slices, k)
    assert len(stages) == sum(s > 1 for s in shape)
    for groups, _ in stages:
        assert sorted(d for g in groups for d in g) == list(range(slices * k))
        assert all(len({d // k for d in g}) == 1 for g in groups)
    data = np.random.default_rng(1).standard_normal((slices * k, k * 2))
    want = np.concatenate([np.stack(np.split(data[s * k:(s + 1) * k].sum(0), k)) for s in range(slices)])
    np.testing.assert_allclose(_staged(data, stages), want, rtol=1e-12, atol=1e-12)
