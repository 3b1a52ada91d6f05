"""`FSDPParamGroup`: the parameters of one unit and its collectives.

One flat all-gather rebuilds all of a unit's parameters (`unshard`), one flat reduce-scatter (optionally bucketed) turns
their full gradients into shard gradients (`reduce_grads`). With `flatten_parameters=False` each parameter is its own
bucket instead.

[Note: materialize the scattered shard] libtpu may compile a reduce-scatter as an all-reduce of the whole bucket plus a
slice of this device's rows (v4 does so for most of ours), and then fuses the slice into the shard's consumers: the
gradient-norm and clipping fusions and the optimizer update at the end of the step. Each bucket's full-size all-reduce
result then stays live from its layer's backward to the end of the step: at 20B on v4-128, 86 buckets of 288 MiB each,
24 GiB per chip. An optimization barrier on the reduced shard makes the slice a buffer of its own right after the
collective, so the full-size result dies there (it costs a copy of 1/N of the bucket).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

from .collectives import Collectives
from ..options import FSDPOptions, ShardingStrategy
from ..runtime import environment
from .param import FSDPParam


class _GatherParams(torch.autograd.Function):
    """Shards -> full parameters; backward reduce-scatters the full gradients."""

    @staticmethod
    def forward(ctx, group: "FSDPParamGroup", barrier_with, gathered, *shards):
        ctx.group = group
        if gathered is not None:  # gathered earlier (a prefetch): only the autograd wiring is new
            return tuple(gathered)
        return tuple(group.gather(barrier_with, shards=shards))

    @staticmethod
    def backward(ctx, *full_grads):
        group = ctx.group
        shard_grads = group.reduce_grads(full_grads)
        group.on_grads_reduced(shard_grads)
        return (None, None, None, *shard_grads)


def _gather_flat(comm: Collectives, pieces, dtype, barrier_with) -> List[torch.Tensor]:
    """One all-gather of the concatenated shards of `pieces` ((FSDPParam, local shard) pairs), or of a lone parameter's
    rows in their own shape ([Note: gathering rows]): each parameter whole, in `dtype` (None: its shard's). No autograd."""
    if len(pieces) == 1 and pieces[0][0].row_shape:  # [Note: gathering rows]
        p, shard = pieces[0]
        rows = shard.to(dtype or shard.dtype).reshape(p.shard_shape)
        if barrier_with and comm.is_xla:
            rows = comm.optimization_barrier([rows, *barrier_with])[0]
        return [p.unpad(comm.all_gather_rows(rows))]
    flat = torch.cat([s.to(dtype or s.dtype).reshape(-1) for _, s in pieces])
    if barrier_with and comm.is_xla:
        flat = comm.optimization_barrier([flat, *barrier_with])[0]
    gathered = comm.all_gather(flat).view(comm.layout.shard_world_size, -1)
    out, offset = [], 0
    for p, _ in pieces:
        out.append(p.unpad(gathered[:, offset: offset + p.shard_numel].reshape(p.padded_rows, *p.row_shape)))
        offset += p.shard_numel
    return out


def gather_together(first: "FSDPParamGroup", second: "FSDPParamGroup",
                    barrier_with: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Both groups' parameters in compute dtype from one collective ([Note: the first gather of a step]).
    `first.gathers_with(second)` must hold. No autograd."""
    dtype = first.options.mixed_precision.compute_dtype
    with torch.no_grad():
        pieces = list(zip(first.params, first.local_shards())) + list(zip(second.params, second.local_shards()))
        full = _gather_flat(first.comm, pieces, dtype, barrier_with)
    return full[:len(first.params)], full[len(first.params):]


# [Note: buckets] A flat bucket costs copies: the gathered buffer holds every rank's shards one after another, so each
# parameter is cut out of it (and each gradient packed into it) with a copy of its full size. A parameter gathered on
# its own needs no copy (the gathered rows are the parameter), but each collective has a fixed cost: a rendezvous on
# every device, and on a TPU a launch latency. So by default (`flatten_parameters=None`) the small parameters of a unit
# (biases, norms: at most `small_param_numel` elements) share one bucket, whose copies are cheap, and each large
# parameter (the weights, nearly all the bytes) has a collective of its own. Measured on the CPU benchmark
# (bench/step_time.py, GPT-2 d256, 8 devices): one flat bucket per unit 1.12x, one collective per parameter 1.07x, this
# 0.95x the step time of the GSPMD engine. `True` and `False` keep torch_xla's meanings.


# [Note: gathering rows] A TPU lays a 2-D array out in tiles of 8 rows x 128 lanes and a 1-D one in tiles of its own, so
# a weight gathered as a flat buffer and viewed as [rows, cols] is a relayout: a copy of the whole weight on every
# gather. A parameter that has a collective of its own (a large one: [Note: buckets]) is gathered in its shard's own
# shape, [rows/N, cols] along dim 0, so the gathered rows are the weight as the matmul reads it: the same rows in the
# same order, without the copy (rings keep their flat chunks: ring.py). Its gradient is scaled in its own shape,
# reduce-scattered flat and its shard taken as rows again before the barrier that materializes it
# ([Note: materialize the scattered shard]). Reduce-scattered as [rows, cols] too, libtpu 0.0.21 kept the first torus
# stage of each weight synchronous on v4-512 (a 3-block copy of the blog's 128B: async bytes 0.91 -> 0.69); the flat
# [rows, 128] buffers it fuses into its asynchronous reduce-scatters. Compiled for v4-512 / v4-128 (libtpu 0.0.21
# deviceless, PROJECTED): the 128B 3-block copy 0.871 -> 0.846 s, the full 20B 5.264 -> 5.148 s.


def gather_buckets(numels: Sequence[int], options) -> List[List[int]]:
    """Which parameters (by position; `numels`: their padded sizes) share a collective."""
    if not numels:
        return []
    if options.flatten_parameters:
        return [list(range(len(numels)))]
    if options.flatten_parameters is False:
        return [[i] for i in range(len(numels))]
    small = [i for i, n in enumerate(numels) if n <= options.small_param_numel]
    large = [[i] for i, n in enumerate(numels) if n > options.small_param_numel]
    return ([small] if small else []) + large


class FSDPParamGroup:
    def __init__(self, params: List[FSDPParam], comm: Collectives, options: FSDPOptions):
        self.params = params
        self.comm = comm
        self.options = options
        self.on_grads_reduced = lambda reduced: None  # set by the owning state
        # [Note: sharding groups] HYBRID_SHARD (and NO_SHARD) replicate shards across groups and average gradients over
        # all of them; FULL_SHARD / SHARD_GRAD_OP with sharding_groups mean what torch_xla means: FSDP inside each
        # group, mixed with model parallelism across groups, so gradients are averaged within the group alone.
        self.across_replicas = options.strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.NO_SHARD)
        # [Note: gradient accumulation without communication] With gradient sync off (`no_sync()`,
        # `set_requires_gradient_sync(False)`) backward reduces nothing: each parameter's full local gradient is added
        # to `pending` (full size on every rank, the memory torch_xla's no_sync also costs) and folded into the next
        # synced reduce-scatter.
        self.requires_grad_sync = True
        self.ends_backward = False  # the root's: its reduce-scatters are a step's last
        self.pending: dict = {}
        self.grad_factor = 1.0  # FSDP2's set_gradient_divide_factor: a multiplier on the reduced gradients
        self.gather_buckets = gather_buckets([p.padded_rows * p.row_numel for p in params], options.collectives)
        self.reduce_buckets = self._reduce_buckets()

    def _reduce_buckets(self) -> List[List[int]]:
        cap_mb = self.options.collectives.reduce_scatter_bucket_size_mb
        if not self.options.collectives.flatten_parameters:
            return self.gather_buckets
        if cap_mb <= 0:
            return [list(range(len(self.params)))] if self.params else []
        elem = torch.finfo(self.options.mixed_precision.reduce_dtype).bits // 8
        buckets, cur, cur_bytes = [], [], 0
        for i, p in enumerate(self.params):
            nbytes = p.shard_numel * p.world * elem
            if cur and cur_bytes + nbytes > cap_mb * 2**20:
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += nbytes
        return buckets + ([cur] if cur else [])

    @property
    def shards(self) -> List[torch.nn.Parameter]:
        return [p.sharded for p in self.params]

    # -- gather -------------------------------------------------------------
    def local_shards(self, grad: bool = False) -> List[torch.Tensor]:
        """Each parameter's shard on this device (inside the single-controller runtime's region, this device's piece of
        the global parameter)."""
        return [self.comm.local_view(p.sharded, "param", grad) for p in self.params]

    def gather(self, barrier_with: Sequence[torch.Tensor] = (), full_precision: bool = False,
               shards: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """All-gather every parameter of the unit in compute dtype, or in the shards' dtype with `full_precision` (for
        saving). No autograd."""
        dtype = None if full_precision else self.options.mixed_precision.compute_dtype
        out: List[Optional[torch.Tensor]] = [None] * len(self.params)
        with torch.no_grad():
            shards = self.local_shards() if shards is None else [s.detach() for s in shards]
            for bucket in self.gather_buckets:
                pieces = [(self.params[i], shards[i]) for i in bucket]
                for i, t in zip(bucket, _gather_flat(self.comm, pieces, dtype, barrier_with)):
                    out[i] = t
        return out  # type: ignore[return-value]

    def _one_flat_bucket(self) -> bool:
        """Every parameter gathered in one collective, each copied out of it."""
        return len(self.gather_buckets) == 1 and len(self.gather_buckets[0]) > 1

    def gathers_with(self, other: "FSDPParamGroup") -> bool:
        """Whether `gather_together` can serve both groups with one collective: each gathers as one flat bucket (so
        joining them copies nothing more), alike."""
        a, b = self.comm, other.comm
        return bool(self._one_flat_bucket() and other._one_flat_bucket() and a.is_xla and type(a) is type(b)
                and a.layout.shard_groups == b.layout.shard_groups and a.device == b.device
                and self.options.mixed_precision.compute_dtype == other.options.mixed_precision.compute_dtype)

    def full_params(self) -> List[torch.Tensor]:
        """Every parameter of the unit, whole and in its own dtype, for saving or inspection (the single controller holds
        each as one global tensor already: nothing is gathered there)."""
        if self.comm.is_single_controller:
            with torch.no_grad():
                return [p.unpad(p.sharded.detach()) for p in self.params]
        return self.gather(full_precision=True)

    def gather_for_forward(self, barrier_with: Sequence[torch.Tensor],
                           gathered: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """Full parameters wired into autograd, so their gradients flow back to the shards; `gathered`: the output of an
        earlier `gather` to wire instead of gathering again."""
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in self.params):
            return gathered if gathered is not None else self.gather(barrier_with)
        return list(_GatherParams.apply(self, tuple(barrier_with), gathered, *self.local_shards(grad=True)))

    # -- reduce -------------------------------------------------------------
    # [Note: cross-slice all-reduces in the backward] libtpu 0.0.21 issues a multislice step's cross-slice all-reduces
    # after the backward, however early their shards are ready (the 2B on 2 x v4-8: the first at 98% of the step), so
    # only the optimizer hides the DCN. Each reduction's input passes through an optimization barrier with the
    # slice-reduced shards of the reductions SLICE_LAG before it: those transfers must land before it starts, so they
    # run beside the backward. Values are unchanged (a barrier only orders).
    SLICE_LAG = 2

    def _slice_reduced(self) -> list:
        if not hasattr(self.comm, "_slice_reduced"):
            self.comm._slice_reduced = []
        return self.comm._slice_reduced

    def _across_slices(self) -> bool:
        return self.across_replicas and self.comm.is_xla and environment.num_slices() > 1

    def _after_earlier_slice_reductions(self, flat: torch.Tensor) -> torch.Tensor:
        if not self._across_slices():
            return flat
        pending = self._slice_reduced()
        losses, self.comm._step_losses = getattr(self.comm, "_step_losses", []), []
        lag = 0 if self.ends_backward else self.SLICE_LAG  # the step's last reduction: the next step starts afresh
        older = pending[:max(0, len(pending) - lag)]
        del pending[:len(older)]
        return self.comm.optimization_barrier([flat, *older, *losses])[0] if older or losses else flat

    def hold_step_loss(self, out) -> None:
        """[Note: the loss before the backward's reductions] libtpu 0.0.21 scheduled a multislice step's loss (nll_loss
        over the logits) late in the backward (the 2B on 2 x v4-8: at 79% of the step, after the first cross-slice
        send), keeping the logits alive until then; one slice's program computes it at the backward's start, in the
        fusion that makes the logits' gradient. The root's scalar outputs go through the first reduction's barrier, so
        the loss is computed before any gradient is reduced. Measured on that 2B (PROJECTED, docs/pods.md): the DCN wait
        0.088 -> 0.056 s, the step 3.708 -> 3.673 s; the peak HBM did not drop (23.42 -> 23.70 GiB)."""
        if self._across_slices():
            self.comm._step_losses = [t.detach() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                                      and t.dim() == 0 and t.is_floating_point()]

    def reduce_grads(self, full_grads: Sequence[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Full gradients -> shard gradients summed over every rank holding a replica of the shard, scaled so the result
        is the gradient of the global loss."""
        scale = self.comm.grad_scale(self.across_replicas) * self.grad_factor
        rdtype = self.options.mixed_precision.reduce_dtype
        out: List[Optional[torch.Tensor]] = [None] * len(self.params)
        with torch.no_grad():
            for bucket in self.reduce_buckets:
                live = [i for i in bucket if self.params[i].requires_grad]
                if not live:
                    continue
                chunks = []
                for i in live:
                    g = full_grads[i]
                    if g is None:
                        g = torch.zeros(self.params[i].orig_shape, dtype=rdtype, device=self.comm.device)
                    chunk = self.params[i].pad_grad(g.to(rdtype))
                    if i in self.pending:
                        chunk = chunk + self.comm.unstash(self.pending[i]).to(rdtype)
                    chunks.append(chunk)
                if not self.requires_grad_sync:
                    for i, chunk in zip(live, chunks):
                        self.pending[i] = self.comm.stash(chunk)
                    continue
                for i in live:
                    self.pending.pop(i, None)
                alone = self.params[live[0]] if len(live) == 1 and self.params[live[0]].row_shape else None
                if alone is not None:  # [Note: gathering rows]: scaled in its own shape, its rows after
                    flat = (chunks[0].view(alone.padded_rows, *alone.row_shape) * scale).reshape(-1)
                else:
                    flat = torch.cat(chunks, dim=1).reshape(-1) * scale  # pre-divide: keeps bf16 sums in range
                flat = self._after_earlier_slice_reductions(flat)
                shard = self.comm.reduce_scatter(flat, follow_chain=not self.ends_backward)
                if alone is not None:
                    shard = shard.view(alone.shard_shape)
                if self.across_replicas:
                    shard = self.comm.all_reduce(shard, "replicate")
                    if self._across_slices() and not self.ends_backward:
                        self._slice_reduced().append(shard)
                if self.comm.is_xla:  # [Note: materialize the scattered shard]
                    shard = self.comm.optimization_barrier([shard])[0]
                if alone is not None:
                    out[live[0]] = shard.to(alone.orig_dtype)
                    continue
                offset = 0
                for i in live:
                    p = self.params[i]
                    out[i] = shard[offset: offset + p.shard_numel].view(p.shard_shape).to(p.orig_dtype)
                    offset += p.shard_numel
        return out
