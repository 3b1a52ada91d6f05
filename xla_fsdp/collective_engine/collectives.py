"""Every collective the engine issues, behind one small interface.

`Collectives` is what a parameter group talks to. Implementations:
`XlaCollectives` (pinned-layout HLO collectives, rank-independent graphs),
`SpmdCollectives` (the same inside one SPMD program, the single controller) and
`DistCollectives` (dist_collectives.py: torch.distributed, e.g. gloo on CPU
tensors, so the same engine trains across real processes on a machine without
accelerators).
Tests and benchmarks may pass their own implementation.

[Note: rank as data] On XLA every replica must compile the same program, and
collectives in separately compiled programs never rendezvous. So nothing here
may depend on the rank as a Python constant: the all-reduce emulation of
all-gather places the shard with `index_copy` at an index held in a device
tensor (data), not with a rank-dependent pad.

[Note: the last reduce-scatter] torch_xla threads a per-device token through
its collectives: each reads the token and publishes a new one that depends on
its result, so the next one waits for it. For reduce-scatters this bounds
how long full gradients live: unit k's must be reduced before the re-gather
two units later starts. But the last reduce-scatter of a backward (the
root's) then waits for block 0's, which waits for block 0's weight-gradient
matmuls, the step's last, and has nothing to overlap with. So it starts from
a fresh token (`follow_chain=False`) and runs beside those matmuls; it still
publishes, so what follows it (clipping's all-reduce) waits. A root that
reduces with an all-reduce alone (NO_SHARD: the reduce-scatter is a no-op)
starts that all-reduce from a fresh token the same way. Measured on the
traced program (tests/test_overlap.py). Dropping the chain for every
reduce-scatter also overlaps, but leaves their placement, and so gradient
memory, to the compiler, and cost 7% step time on XLA:CPU.
"""
from __future__ import annotations

import abc
import contextlib
from typing import List, Optional, Sequence, Tuple

import torch

from .. import abstract
from ..options import CollectiveOptions, ShardingLayout
from ..tpu import libtpu_flags
from . import auto, ring, torus
from .conversions import ToLocal, to_global, to_local

REDUCE_SUM = "sum"
REDUCE_MAX = "max"
# [Note: 2-D reduce-scatter] libtpu 0.0.21 compiles a reduce-scatter of a 1-D operand (our flat
# buckets) as an all-reduce of the whole buffer followed by a slice: twice the bytes on the ring.
# On v5e and v6e a 2-D operand with at least 8 rows per shard stays a reduce-scatter (compiled
# and checked: tests/test_tpu_compile_matrix.py); v4 turns many into all-reduces (torus.py). So a
# flat buffer whose shard divides into such rows is scattered as [rows, RS_LANES]: row-major,
# each device's rows are exactly its flat shard, so the result is the same.
RS_LANES = 128
RS_MIN_ROWS = 8


class Collectives(abc.ABC):
    """Communication within a sharding layout (shard group and replicate group)."""

    layout: ShardingLayout
    device: torch.device

    @abc.abstractmethod
    def all_gather(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """1-D shard -> 1-D concatenation of every shard-group member's shard, in group order."""

    @abc.abstractmethod
    def reduce_scatter(self, flat: torch.Tensor, follow_chain: bool = True) -> torch.Tensor:
        """1-D tensor of N equal chunks -> this rank's chunk summed over the shard group.
        `follow_chain=False`: need not wait for earlier collectives ([Note: the last reduce-scatter])."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: str, op: str = REDUCE_SUM) -> torch.Tensor:
        """Reduce over the "shard" group, the "replicate" group, the whole "world", or explicit rank
        groups (a tuple of tuples, every rank in one); returns a new tensor."""

    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Keep the compiler from moving work across this point. Identity off XLA."""
        return list(tensors)

    def sync(self, tensors: Sequence[torch.Tensor]) -> None:
        """Materialize pending work for these tensors. No-op off XLA."""

    def stash(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep a per-device tensor beyond the current step (see `unstash`)."""
        return tensor

    def unstash(self, kept: torch.Tensor) -> torch.Tensor:
        """This device's tensor again, from what `stash` returned."""
        return kept

    def barrier(self) -> None:
        """Wait until every process of the job gets here (host side, for files). One process: no-op."""

    def all_ok(self, ok: bool) -> bool:
        """Whether `ok` holds on every process of the job (host side, for files)."""
        return ok

    @property
    def is_xla(self) -> bool:
        return False

    @property
    def is_single_controller(self) -> bool:
        """One process driving every device (see manual_region.py), or one process per replica."""
        return False

    def grad_scale(self, across_replicas: bool) -> float:
        """Factor on full gradients before they are summed: each rank's loss is its own mean,
        so the sum over the ranks that reduce together becomes their average."""
        if across_replicas:
            return 1.0 / (self.layout.shard_world_size * self.layout.replicate_world_size)
        return 1.0 / self.layout.shard_world_size

    def local_view(self, tensor: torch.Tensor, kind: str = "param", grad: bool = True) -> torch.Tensor:
        """This device's piece of a tensor (parameters are already local: one process per replica)."""
        return tensor if grad else tensor.detach()

    def global_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """A value equal on every device, as seen from outside the device program."""
        return tensor


def as_rows(flat: torch.Tensor, count: int) -> torch.Tensor:
    """`flat` as [rows, RS_LANES] when each of `count` shards is at least RS_MIN_ROWS whole rows
    ([Note: 2-D reduce-scatter]); otherwise `flat` itself."""
    if flat.dim() == 1 and flat.numel() % (count * RS_LANES) == 0 and \
            flat.numel() // (count * RS_LANES) >= RS_MIN_ROWS:
        return flat.view(-1, RS_LANES)
    return flat


def _groups_arg(groups: Tuple[Tuple[int, ...], ...]) -> List[List[int]]:
    return [list(g) for g in groups]


class XlaCollectives(Collectives):
    """Pinned-layout XLA collectives (TPU; XLA:CPU at world size 1 or traced)."""

    def __init__(self, layout: ShardingLayout, options: CollectiveOptions, device=None):
        import torch_xla

        self._xlac = torch_xla._XLAC
        self.layout = layout
        # one process per chip: "auto" is the pinned gather ([Note: rings by default on a TPU]);
        # SpmdCollectives resolved its own already, which leaves nothing to resolve here
        options = self.options = auto.resolve(options, single_controller=False)
        self.device = device if device is not None else torch_xla.device()
        # what every collective passes as pin_layout; SpmdCollectives overrides it
        self._pin_layout = options.pin_layout
        if options.all_gather_impl == "ring" and not self.is_single_controller:
            raise ValueError("all_gather_impl='ring' needs the single-controller runtime (one process "
                             "drives every device); with one process per chip use 'all_gather'")
        # the shard rank enters graphs as data (see [Note: rank as data])
        self._rank = torch.tensor([layout.shard_rank], dtype=torch.long).to(self.device)

    # channel id and global device ids: none between processes ([Note: channel ids])
    _channel: Tuple = (None, None)

    def _rank_index(self) -> torch.Tensor:
        return self._rank

    def loop_constants(self) -> List[torch.Tensor]:
        """The per-device tensors the collectives read, for a loop body to take as inputs
        ([Note: a loop in the manual region]); none here."""
        return []

    @contextlib.contextmanager
    def constants_from(self, values: Sequence[torch.Tensor]):
        """While tracing a loop body: read the constants from `values` (`loop_constants`'s order)."""
        yield

    @property
    def is_xla(self) -> bool:
        return True

    def _group(self, name):
        if isinstance(name, tuple):  # explicit rank groups (torch_xla's clip_grad_norm_(groups=))
            return _groups_arg(name), len(name[0])
        if name == "world":
            return [list(range(self.layout.world_size))], self.layout.world_size
        groups = self.layout.shard_groups if name == "shard" else self.layout.replicate_groups
        return _groups_arg(groups), len(groups[0])

    def all_gather(self, flat_shard):
        groups, count = self._group("shard")
        if count == 1:
            return flat_shard
        if self.options.all_gather_impl == "all_gather":
            return self._xlac._xla_all_gather(flat_shard, 0, count, groups, self._pin_layout,
                                              *self._channel)
        # emulation: zero buffer with our shard at row `rank`, summed across the group
        buf = torch.zeros(count, flat_shard.numel(), dtype=flat_shard.dtype, device=flat_shard.device)
        buf = buf.index_copy(0, self._rank_index(), flat_shard.unsqueeze(0))
        return self.all_reduce(buf.reshape(-1), "shard")

    def reduce_scatter(self, flat, follow_chain=True):
        groups, count = self._group("shard")
        device = str(self.device)
        if not follow_chain:  # [Note: the last reduce-scatter]; with NO_SHARD, for the all-reduce after it
            self._xlac._set_all_reduce_token(device, None)
        if count == 1:
            return flat
        token = self._xlac._get_all_reduce_token(device)
        out = flat
        for stage_groups, stage_count in self._scatter_stages(flat, groups, count):
            # every stage waits for the same token (a later stage waits for the earlier one's data
            # anyway); only the last publishes: a token read from an intermediate result keeps
            # libtpu from fusing that stage into its reduce-scatter emitter (torus.py)
            out, new_token = self._xlac._xla_reduce_scatter(
                REDUCE_SUM, as_rows(out, stage_count), token, 1.0, 0, stage_count, stage_groups,
                self._pin_layout, *self._channel)
            out = out.reshape(-1)
        self._xlac._set_all_reduce_token(device, new_token)
        return out

    def _scatter_stages(self, flat, groups, count) -> List[Tuple[List[List[int]], int]]:
        """The reduce-scatters that together scatter `flat` over the shard group, in order, each
        as (replica groups, devices per group): here one over the whole group."""
        return [(groups, count)]

    def all_reduce(self, tensor, group, op=REDUCE_SUM):
        groups, count = self._group(group)
        if count == 1:
            return tensor
        return self._xlac._xla_all_reduce(op, tensor, 1.0, groups, self._pin_layout)

    def optimization_barrier(self, tensors):
        out = [t.clone() for t in tensors]  # the barrier is in place; never touch the caller's tensors
        self._xlac._xla_optimization_barrier_(out)
        return out

    def sync(self, tensors):
        tensors = [t for t in tensors if t is not None]
        if tensors and not abstract.active():  # placeholders never run ([Note: abstract tracing])
            self._xlac._xla_sync_multi(tensors, devices=[], wait=False)

    def barrier(self):
        if self.layout.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("xla_fsdp.barrier")

    def all_ok(self, ok):
        if self.layout.world_size == 1:
            return ok
        import torch_xla.core.xla_model as xm

        return bool(xm.mesh_reduce("xla_fsdp.all_ok", int(bool(ok)), min))


# [Note: channel ids] Inside a manual-sharding region a collective runs
# across the partitions of one SPMD program, which XLA expresses with a
# channel id and global device ids (`use_global_device_ids`). Without them XLA
# reads the groups as replica ids, and an SPMD program has one replica. The
# channel id only marks the collective as cross-partition (one program,
# nothing to pair up), so every collective carries the same one and the
# traced graph stays identical from step to step.
SPMD_CHANNEL_ID = 1

# [Note: no pinning in one program] `pin_layout_in_collective_ops` exists so
# that separately compiled per-process programs agree on the memory layout of
# what they exchange. The single-controller runtime compiles ONE program for
# every device, so there is nothing to agree on, and pinning does harm on a
# TPU: libtpu refuses a module that mixes layout-constrained and
# unconstrained all-reduces ("HloModule has a mix of layout constrained and
# unconstrained AllReduce instructions"; a reduce-scatter counts, it becomes
# an all-reduce), and torch_xla 2.9 has no pinned cross-partition all-reduce
# while the SPMD partitioner adds unpinned ones of its own. Pinned collectives
# are also never made asynchronous by the TPU compiler. So this runtime issues
# every collective unpinned, whatever the option says (checked by compiling
# the step for v4-8 and v5e-8 in tests/test_tpu_compile_matrix.py).


def _torus_known() -> bool:
    try:
        return torus.slice_shape() is not None
    except ValueError:  # a malformed XLA_FSDP_TORUS: the rings' own check says so
        return True


class SpmdCollectives(XlaCollectives):
    """The same collectives between the devices of one process, inside manual-sharding regions,
    unpinned ([Note: no pinning in one program]).

    The single-controller runtime ([Note: single-controller runtime] in
    manual_region.py). Groups are device ids; parameters are global tensors
    and `local_view` gives a device's piece inside the region. Gradients
    arrive pre-scaled by the region's output rules, so reduce-scatters sum.
    """

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
            every = list(range(placement.num_devices))
            if [list(g) for g in placement.shard_groups] != [every]:
                raise ValueError(
                    f"{' and '.join(asked)} needs one shard group holding every device in id order, "
                    f"not {[list(g) for g in placement.shard_groups]}; use 'auto' or 'flat' stages and "
                    f"the 'all_gather' gather with sharding groups")
            self._rings = ring.TorusRings(torus.slice_shape() or (len(every),))
            if self._rings.devices != len(every):
                raise ValueError(f"{torus.ENV} names a slice of {self._rings.devices} devices; "
                                 f"this job has {len(every)}")
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

    _given: Optional[Sequence[torch.Tensor]] = None  # constants_from's, while a loop body is traced

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
    def constants_from(self, values):
        self._given = list(values)
        try:
            yield
        finally:
            self._given = None

    def all_gather(self, flat_shard):
        if self._rings is None or self.options.all_gather_impl != "ring":
            return super().all_gather(flat_shard)
        return self._rings.all_gather(flat_shard, self._my_ring_orders())

    def reduce_scatter(self, flat, follow_chain=True):
        if self._rings is None or self.options.reduce_scatter_stages != "ring":
            return super().reduce_scatter(flat, follow_chain)
        # [Note: ring reduce-scatter]: permutes made by the partitioner carry no token, so this
        # neither waits for nor orders later collectives through it
        return self._rings.reduce_scatter(flat, self._my_ring_orders())

    def _scatter_stages(self, flat, groups, count):
        if self._stages is None:
            self._stages = torus.stages(groups[0], torus.slice_shape(), self.options.reduce_scatter_stages) \
                if len(groups) == 1 else []
        # a bucket too small for whole rows of every stage's shards is an all-reduce either way
        # ([Note: 2-D reduce-scatter]); staged, libtpu also merges it with its neighbours' stages
        if self._stages and as_rows(flat, count).dim() == 2:
            return self._stages  # [Note: one reduce-scatter per torus axis]
        return super()._scatter_stages(flat, groups, count)

    def all_reduce(self, tensor, group, op=REDUCE_SUM):
        groups, count = self._group(group)
        if count == 1:
            return tensor
        # torch_xla 2.9 has no layout-pinned cross-partition all-reduce; pinning guards
        # separately compiled programs, and here one program serves every device
        return self._xlac._xla_spmd_all_reduce(op, tensor, 1.0, groups)
