"""Every collective the engine issues, behind one small interface.

`Collectives` is what a parameter group talks to: `XlaCollectives` (pinned-layout HLO collectives, rank-independent
graphs), `SpmdCollectives` (region_collectives.py: the same inside the single controller's one SPMD program),
`DistCollectives` (dist_collectives.py: torch.distributed, e.g. gloo on CPU tensors across real processes), or a test's
or benchmark's own.

[Note: rank as data] On XLA every replica must compile the same program (collectives of separately compiled programs
never rendezvous), so nothing here depends on the rank as a Python constant: the all-reduce emulation of all-gather
places the shard with `index_copy` at an index held in a device tensor, not with a rank-dependent pad.

[Note: the last reduce-scatter] torch_xla threads a per-device token through its collectives: each reads the token and
publishes one that depends on its result, so the next waits for it. For reduce-scatters this bounds how long full
gradients live (unit k's is reduced before the re-gather two units later starts). But the root's reduce-scatter, the
backward's last, would then wait for block 0's, which waits for the step's last matmuls: nothing to overlap with. So it
starts from a fresh token (`follow_chain=False`) and runs beside those matmuls; it still publishes, so what follows
(clipping's all-reduce) waits. A NO_SHARD root's all-reduce starts fresh alike (checked on the traced program:
tests/test_overlap.py). Dropping the chain for every reduce-scatter also overlaps, but leaves gradient memory to the
compiler (7% step time on XLA:CPU).

[Note: collectives off the chain] Reading the token costs an elementwise pass: torch_xla adds it to the collective's
input, so every reduce-scatter's input is a fresh copy of the gradient, and libtpu keeps most reduce-scatters fed by
such a pass synchronous. `token_chain="gathers"` starts every reduce-scatter from a fresh token (a constant zero XLA
folds away) and still publishes. `token_chain="off"` starts the gathers fresh too: libtpu orders the engine's
collectives (the same order on every device of the single controller's one program; with one process per chip not
measured). tests/test_overlap.py checks both; the 8-device parity run and the shipped Llama config use "off" (a shorter
step there: docs/performance.md). Not the default: freed of the order, the scheduler starts reductions and gathers
earlier and peaks higher (a 3-block copy of GPT-2 128B for v4-512: 12.98 GiB instead of 8.86).

[Note: the gradient apart from the chain] libtpu fuses the token add into the matmul that makes the gradient: the next
weight's gradient matmul then waits for the previous reduce-scatter, and where no recomputed forward runs beside them
(blocks that keep their activations) libtpu keeps each reduce-scatter's first torus stage synchronous. A staged
reduce-scatter (more than one torus stage: by default on slices of more than 64 chips) that follows the chain takes the
gradient through an optimization barrier first, so the add is a pass of its own, fused into the asynchronous
reduce-scatter ([Note: asynchronous staged reduce-scatters] in tpu/libtpu_flags.py), and the matmul waits for nothing;
the chain's order and memory bound stay. Off the chain the token is a folded zero and the barrier would only cost the
pass (measured: 0.88 -> 0.95 of the bytes beside compute for the 128B on v4-512; the 64B on v4-256 pays the pass).
"""
from __future__ import annotations

import abc
import contextlib
from typing import List, Sequence, Tuple

import torch

from .. import abstract
from ..runtime.barrier import optimization_barrier as _optimization_barrier
from ..options import CollectiveOptions, ShardingLayout
from . import auto

REDUCE_SUM = "sum"
REDUCE_MAX = "max"
# [Note: 2-D reduce-scatter] libtpu 0.0.21 compiles a reduce-scatter of a 1-D operand (our flat buckets) as an
# all-reduce of the whole buffer followed by a slice: twice the bytes on the ring. On v5e and v6e a 2-D operand with at
# least 8 rows per shard stays a reduce-scatter (compiled and checked: tests/test_tpu_compile_matrix.py); v4 turns many
# into all-reduces (torus.py). So a flat buffer whose shard divides into such rows is scattered as [rows, RS_LANES]:
# row-major, each device's rows are exactly its flat shard, so the result is the same.
RS_LANES = 128
RS_MIN_ROWS = 8


class Collectives(abc.ABC):
    """Communication within a sharding layout (shard group and replicate group)."""

    layout: ShardingLayout
    device: torch.device

    @abc.abstractmethod
    def all_gather(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """1-D shard -> 1-D concatenation of every shard-group member's shard, in group order."""

    def all_gather_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """A shard of rows ([rows, ...]) -> every shard-group member's rows, stacked in group order
        ([Note: gathering rows])."""
        return self.all_gather(shard.reshape(-1)).view(-1, *shard.shape[1:])

    @abc.abstractmethod
    def reduce_scatter(self, flat: torch.Tensor, follow_chain: bool = True) -> torch.Tensor:
        """1-D tensor of N equal chunks -> this rank's chunk summed over the shard group.
        `follow_chain=False`: need not wait for earlier collectives ([Note: the last reduce-scatter])."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: str, op: str = REDUCE_SUM) -> torch.Tensor:
        """Reduce over the "shard" group, the "replicate" group, the whole "world", or explicit rank groups (a tuple of
        tuples, every rank in one); returns a new tensor."""

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

    def smallest(self, n: int) -> int:
        """The smallest `n` of every process of the job (host side: one choice for one program)."""
        return n

    @property
    def is_xla(self) -> bool:
        return False

    @property
    def is_single_controller(self) -> bool:
        """One process driving every device (see manual_region.py), or one process per replica."""
        return False

    def grad_scale(self, across_replicas: bool) -> float:
        """Factor on full gradients before they are summed: each rank's loss is its own mean, so the sum over the ranks
        that reduce together becomes their average."""
        return 1.0 / (self.layout.shard_world_size * (self.layout.replicate_world_size if across_replicas else 1))

    def local_view(self, tensor: torch.Tensor, kind: str = "param", grad: bool = True) -> torch.Tensor:
        """This device's piece of a tensor (parameters are already local: one process per replica)."""
        return tensor if grad else tensor.detach()

    def global_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """A value equal on every device, as seen from outside the device program."""
        return tensor


def as_rows(flat: torch.Tensor, count: int) -> torch.Tensor:
    """`flat` as [rows, RS_LANES] when each of `count` shards is at least RS_MIN_ROWS whole rows
    ([Note: 2-D reduce-scatter]); otherwise `flat` itself."""
    if flat.dim() == 1 and flat.numel() % (count * RS_LANES) == 0 and flat.numel() // (count * RS_LANES) >= RS_MIN_ROWS:
        return flat.view(-1, RS_LANES)
    return flat


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
    def loop_body(self, constants: Sequence[torch.Tensor]):
        """While a loop body is traced: its collectives start from a fresh token, and the token outside is put back
        after (a token made in the body must not be what the program after the loop reads); the per-device constants are
        read from `constants` (`loop_constants`'s order)."""
        device = str(self.device)
        saved = self._xlac._get_all_reduce_token(device)
        self._xlac._set_all_reduce_token(device, None)
        try:
            yield
        finally:
            self._xlac._set_all_reduce_token(device, saved)

    @property
    def is_xla(self) -> bool:
        return True

    def _group(self, name):
        if isinstance(name, tuple):  # explicit rank groups (torch_xla's clip_grad_norm_(groups=))
            return [list(g) for g in name], len(name[0])
        if name == "world":
            return [list(range(self.layout.world_size))], self.layout.world_size
        groups = self.layout.shard_groups if name == "shard" else self.layout.replicate_groups
        return [list(g) for g in groups], len(groups[0])

    def all_gather(self, flat_shard):
        groups, count = self._group("shard")
        if count == 1:
            return flat_shard
        if self.options.token_chain == "off":  # [Note: collectives off the chain]
            self._xlac._set_all_reduce_token(str(self.device), None)
        if self.options.all_gather_impl == "all_gather":
            return self._xlac._xla_all_gather(flat_shard, 0, count, groups, self._pin_layout,
                                              *self._channel)
        # emulation: zero buffer with our shard at row `rank`, summed across the group
        buf = torch.zeros(count, flat_shard.numel(), dtype=flat_shard.dtype, device=flat_shard.device)
        buf = buf.index_copy(0, self._rank_index(), flat_shard.unsqueeze(0))
        return self.all_reduce(buf.reshape(-1), "shard")

    def all_gather_rows(self, shard):
        if self.options.all_gather_impl != "all_gather":
            return super().all_gather_rows(shard)
        return self.all_gather(shard)  # [Note: gathering rows]: along dim 0, in the rows' own shape

    def reduce_scatter(self, flat, follow_chain=True):
        groups, count = self._group("shard")
        device = str(self.device)
        # [Note: the last reduce-scatter] (with NO_SHARD, for the all-reduce after it); every one
        # off the chain: [Note: collectives off the chain]
        if not follow_chain or self.options.token_chain != "all":
            self._xlac._set_all_reduce_token(device, None)
        if count == 1:
            return flat
        token = self._xlac._get_all_reduce_token(device)  # a constant zero when none was published
        stages = self._scatter_stages(flat, groups, count)
        chained = follow_chain and self.options.token_chain == "all"
        if chained and len(stages) > 1:  # [Note: the gradient apart from the chain]
            flat = self.optimization_barrier([flat])[0]
        out = flat
        for stage_groups, stage_count in stages:
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
        """The reduce-scatters that together scatter `flat` over the shard group, in order, each as (replica groups,
        devices per group): here one over the whole group."""
        return [(groups, count)]

    def all_reduce(self, tensor, group, op=REDUCE_SUM):
        groups, count = self._group(group)
        return tensor if count == 1 else self._xlac._xla_all_reduce(op, tensor, 1.0, groups, self._pin_layout)

    def optimization_barrier(self, tensors):
        return _optimization_barrier(tensors)

    def sync(self, tensors):
        tensors = [t for t in tensors if t is not None]
        if tensors and not abstract.active():  # placeholders never run ([Note: abstract tracing])
            self._xlac._xla_sync_multi(tensors, devices=[], wait=False)

    def barrier(self):
        if self.layout.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("xla_fsdp.barrier")

    def all_ok(self, ok):
        return bool(self.smallest(int(bool(ok)))) if self.layout.world_size > 1 else ok

    def smallest(self, n):
        if self.layout.world_size == 1:
            return n
        import torch_xla.core.xla_model as xm

        return int(xm.mesh_reduce("xla_fsdp.smallest", int(n), min))
