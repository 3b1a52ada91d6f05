"""`SpmdCollectives`: the engine's collectives on the single controller, between the devices of
one process inside manual-sharding regions ([Note: single-controller runtime] in manual_region.py).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .. import abstract
from ..options import CollectiveOptions, ShardingLayout
from ..tpu import libtpu_flags
from . import auto, ring, torus
from .collectives import REDUCE_SUM, XlaCollectives, as_rows
from .conversions import ToLocal, to_global, to_local

# [Note: channel ids] Inside a manual-sharding region a collective runs across the partitions of one SPMD program,
# which XLA expresses with a channel id and global device ids (`use_global_device_ids`); without them XLA reads the
# groups as replica ids, and an SPMD program has one replica. The channel id only marks the collective as
# cross-partition (nothing to pair up), so every collective carries the same one and the graph stays identical.
SPMD_CHANNEL_ID = 1

# [Note: no pinning in one program] `pin_layout_in_collective_ops` makes separately compiled per-process programs
# agree on the layout of what they exchange. The single controller compiles ONE program, so there is nothing to
# agree on, and pinning harms on a TPU: libtpu refuses a module that mixes layout-constrained and unconstrained
# all-reduces (a reduce-scatter counts), torch_xla 2.9 has no pinned cross-partition all-reduce while the SPMD
# partitioner adds unpinned ones, and pinned collectives are never made asynchronous. So this runtime issues every
# collective unpinned, whatever the option says (compiled for v4-8 and v5e-8 in tests/test_tpu_compile_matrix.py).


def _torus_known() -> bool:
    """The slice's torus is known and 3-D (v4, v5p): where the reduce-scatters may ring."""
    try:
        return torus.three_axes(torus.slice_shape())
    except ValueError:  # a malformed torus variable: the rings' own check says so
        return True


class SpmdCollectives(XlaCollectives):
    """Unpinned ([Note: no pinning in one program]); groups are device ids; parameters are global tensors, `local_view`
    gives a device's piece inside the region. Gradients arrive pre-scaled by the region's output rules, so
    reduce-scatters sum."""

    _channel = (SPMD_CHANNEL_ID, True)

    def __init__(self, layout: ShardingLayout, options: CollectiveOptions, placement, device=None):
        import torch_xla.distributed.spmd as xs

        options = auto.resolve(options, single_controller=True,
                               rings_possible=auto.rings_apply(placement.shard_groups, placement.num_devices),
                               on_tpu=auto.tpu_target(), rings_enabled=libtpu_flags.rings_enabled(),
                               scatter_rings_possible=auto.scatter_rings_apply(
                                   placement.shard_groups, placement.num_devices, _torus_known()))
        if options.all_gather_impl == "ring" and options.reduce_scatter_stages == "ring":
            auto.warn_if_budget_is_not_the_rings()
        super().__init__(layout, options, device)
        self._pin_layout = False  # [Note: no pinning in one program]
        self.placement = placement
        self._stages = None  # reduce-scatter stages, decided at the first one (torus.py)
        self._rings = None  # "ring" gathers or reduce-scatters: the rings ([Note: ring reduce-scatter])
        asked = [f"{k}='ring'" for k, v in (("all_gather_impl", options.all_gather_impl),
                                            ("reduce_scatter_stages", options.reduce_scatter_stages)) if v == "ring"]
        if asked and layout.shard_world_size > 1:
            groups = placement.shard_groups
            if not auto.ring_groups(groups, placement.num_devices):
                raise ValueError(
                    f"{' and '.join(asked)} needs one shard group holding every device in id order (or one "
                    f"per slice of a multislice job), not {[list(g) for g in groups]}; use 'auto' or 'flat' "
                    f"stages and the 'all_gather' gather with sharding groups")
            # one ring per axis on 3-D slices; one ring through every device on 2-D ones, as
            # measured ([Note: staged on 2-D slices] in torus.py); within each slice on several
            every = list(groups[0])
            shape = torus.slice_shape()
            self._rings = ring.TorusRings(shape if torus.three_axes(shape) else (len(every),), slices=len(groups))
            if self._rings.devices != len(every):
                raise ValueError(f"{torus.ENV} names a slice of {self._rings.devices} devices; "
                                 f"this job's shard groups have {len(every)}")
            # each device's chunk orders, as data (one row per device)
            self._ring_orders = torch.from_numpy(self._rings.orders()).to(self.device)
            xs.mark_sharding(self._ring_orders, placement.mesh, placement.spec("batch", 2))
        # each device's position in its shard group, as data
        self._positions = torch.tensor(placement.shard_positions(), dtype=torch.long).to(self.device)
        xs.mark_sharding(self._positions, placement.mesh, placement.spec("batch", 1))

    @property
    def is_single_controller(self) -> bool:
        return True

    def grad_scale(self, across_replicas: bool) -> float:
        return 1.0

    def stash(self, tensor):
        # a per-device tensor lives on as one global tensor with a leading device dim
        spec = self.placement.spec("batch", tensor.dim() + 1)
        return to_global(tensor.unsqueeze(0), self.placement.mesh, spec,
                         torch.Size([self.placement.num_devices, *tensor.shape]))

    def unstash(self, kept):
        return to_local(kept, self.placement.mesh, self.placement.spec("batch", kept.dim()))[0]

    def barrier(self):
        """One process drives every device: nothing to wait for."""

    def all_ok(self, ok):
        return ok

    def smallest(self, n):
        """One process per host: the hosts' smallest ([Note: the hosts' group] in runtime/hosts.py)."""
        from ..runtime.hosts import host_group, host_view

        view = host_view()
        return n if view.count == 1 else min(host_group(view).all_gather(int(n)))

    def local_view(self, tensor, kind="param", grad=True):
        spec = self.placement.spec(kind, tensor.dim())
        if grad and tensor.requires_grad and torch.is_grad_enabled():
            return ToLocal.apply(tensor, self.placement.mesh, spec, None)
        return to_local(tensor.detach(), self.placement.mesh, spec)

    def global_value(self, tensor):
        return to_global(tensor, self.placement.mesh, self.placement.spec("replicated", tensor.dim()), tensor.shape)

    def place_global(self, padded: torch.Tensor) -> torch.Tensor:
        """A padded full parameter -> the global device tensor, sharded on dim 0."""
        import torch_xla.distributed.spmd as xs

        spec = self.placement.spec("param", padded.dim())
        if padded.is_meta:  # traced for the ahead-of-time check ([Note: abstract tracing])
            return abstract.to_device(padded, self.device, self.placement.mesh.get_op_sharding(spec))
        data = padded.to(self.device)
        xs.mark_sharding(data, self.placement.mesh, spec)
        return data

    _given: Optional[Sequence[torch.Tensor]] = None  # loop_body's, while a loop body is traced

    def _rank_index(self):
        if self._given is not None:
            return self._given[0]
        return to_local(self._positions, self.placement.mesh, self.placement.spec("batch", 1))

    def _my_ring_orders(self):
        if self._given is not None:
            return self._given[1]
        return to_local(self._ring_orders, self.placement.mesh, self.placement.spec("batch", 2))

    def loop_constants(self):
        # the device's position in its group, and its ring orders: global tensors split over the
        # devices, which a loop body inside the region cannot read itself
        return [self._rank_index()] + ([self._my_ring_orders()] if self._rings is not None else [])

    @contextlib.contextmanager
    def loop_body(self, constants):
        self._given = list(constants)
        try:
            with super().loop_body(constants):
                yield
        finally:
            self._given = None

    def all_gather(self, flat_shard):
        if self._rings is None or self.options.all_gather_impl != "ring":
            return super().all_gather(flat_shard)
        return self._rings.all_gather(flat_shard, self._my_ring_orders())

    def all_gather_rows(self, shard):
        if self._rings is None or self.options.all_gather_impl != "ring" or \
                not ring.whole_tiles(shard.shape, shard.element_size()):
            return super().all_gather_rows(shard)
        return self._rings.all_gather_rows(shard, self._my_ring_orders())

    def reduce_scatter(self, flat, follow_chain=True):
        if self._rings is None or self.options.reduce_scatter_stages != "ring":
            return super().reduce_scatter(flat, follow_chain)
        # [Note: ring reduce-scatter]: permutes made by the partitioner carry no token, so this
        # neither waits for nor orders later collectives through it
        return self._rings.reduce_scatter(flat, self._my_ring_orders())

    def _scatter_stages(self, flat, groups, count):
        if self._stages is None:  # one slice's stages, run in every slice at once; other groups flat
            one = torus.stages(groups[0], torus.slice_shape(), self.options.reduce_scatter_stages)
            self._stages = torus.each_slice(one, len(groups), len(groups[0])) \
                if auto.ring_groups(groups, sum(len(g) for g in groups)) else []
        # a bucket too small for whole rows of every stage's shards is an all-reduce either way
        # ([Note: 2-D reduce-scatter]); staged, libtpu also merges it with its neighbours' stages
        if self._stages and as_rows(flat, count).dim() == 2:
            return self._stages  # [Note: one reduce-scatter per torus axis]
        return super()._scatter_stages(flat, groups, count)

    def all_reduce(self, tensor, group, op=REDUCE_SUM):
        groups, count = self._group(group)
        if count == 1:
            return tensor
        # [Note: no pinning in one program]
        return self._xlac._xla_spmd_all_reduce(op, tensor, 1.0, groups)
