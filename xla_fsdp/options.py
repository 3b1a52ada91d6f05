"""Typed policy objects behind the keyword-compatible front door.

The public constructor accepts torch_xla's flat keyword list; `api.py` turns it into these frozen records once, so the
engine never reads loose booleans."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the mesh axis parameters are sharded over (both engines, under the SPMD runtime)
FSDP_AXIS = "fsdp"


class ShardingStrategy(enum.Enum):
    """How parameters and gradients are split across ranks."""

    FULL_SHARD = "FULL_SHARD"  # params, grads, optimizer state all 1/N; regather for backward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # keep gathered params from forward until backward ends
    NO_SHARD = "NO_SHARD"  # replicated params, all-reduced grads (DDP)
    HYBRID_SHARD = "HYBRID_SHARD"  # shard inside `sharding_groups`, replicate across them

    @classmethod
    def parse(cls, value) -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
        valid = ", ".join(cls.__members__)
        raise ValueError(f"sharding_strategy={value!r} is not valid; use one of: {valid}")


class TrainingState(enum.Enum):
    """Where a unit is in its step; transitions are idempotent."""

    IDLE = "IDLE"
    FORWARD = "FORWARD"
    PRE_BACKWARD = "PRE_BACKWARD"


def _check_dtype(name: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes used around the fp32 shards (shards and optimizer state stay fp32)."""

    # dtype of gathered parameters and of the unit's compute; shards are cast before the all-gather, so the gather moves
    # compute-dtype bytes.
    compute_dtype: torch.dtype = torch.float32
    # dtype for floating-point buffers (None: same as compute_dtype)
    buffer_dtype: Optional[torch.dtype] = None
    # reduce-scatter gradients in fp32 even when computing in lower precision
    fp32_reduce_scatter: bool = False

    def __post_init__(self):
        _check_dtype("compute_dtype", self.compute_dtype)
        _check_dtype("buffer_dtype", self.buffer_dtype)

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32_reduce_scatter else self.compute_dtype

    @property
    def effective_buffer_dtype(self) -> torch.dtype:
        return self.buffer_dtype or self.compute_dtype

    @property
    def enabled(self) -> bool:
        return self.compute_dtype != torch.float32


# "auto": collective_engine/auto.py ([Note: rings by default on a TPU]); "ring": [Note: ring reduce-scatter]
ALL_GATHER_IMPLS = ("auto", "all_gather", "all_reduce", "ring")
# "axes": [Note: one reduce-scatter per torus axis]; "ring": [Note: ring reduce-scatter]
REDUCE_SCATTER_STAGES = ("auto", "axes", "flat", "ring")
TOKEN_CHAINS = ("all", "gathers", "off")  # CollectiveOptions.token_chain


@dataclass(frozen=True)
class CollectiveOptions:
    """How a unit talks to its peers. See docs/engines.md, "Gathering: all_gather vs all_reduce"."""

    # pin the layout of every collective (constrain_layout=true in the HLO) so replicas compiling slightly different
    # programs cannot disagree on layouts
    pin_layout: bool = True
    # "auto": "ring" for the single controller on a TPU where rings apply, else "all_gather"
    # ([Note: rings by default on a TPU] in collective_engine/auto.py); "all_gather": native all-gather HLO (moves
    # (N-1)/N of the bytes); "all_reduce": zero-padded all-reduce emulation (2(N-1)/N), torch_xla's pinned default;
    # "ring": single controller only, rings of neighbour exchanges ((N-1)/N, collective_engine/ring.py)
    all_gather_impl: str = "auto"
    # one collective for all parameters of a unit (True), one per parameter (False), or None: small parameters together
    # in one, each large one on its own (see [Note: buckets])
    flatten_parameters: Optional[bool] = None
    # with flatten_parameters=None: parameters of at most this many elements share a bucket
    small_param_numel: int = 2**14
    # split a unit's gradient reduce-scatter into buckets of at most this many MB (0: one bucket)
    reduce_scatter_bucket_size_mb: float = 0.0
    optimization_barrier_in_forward: bool = True
    optimization_barrier_in_backward: bool = True
    # single controller: "auto" rings with the gathers' rings ([Note: rings by default on a TPU]), else "axes"; "axes"
    # reduce-scatters one torus axis at a time on v4/v5p slices, "flat" never
    # ([Note: one reduce-scatter per torus axis]); "ring": rings of neighbour exchanges, one per torus axis
    # ([Note: ring reduce-scatter] in collective_engine/ring.py)
    reduce_scatter_stages: str = "auto"
    # which of the unit's collectives wait for the one before through torch_xla's token chain
    # ([Note: collectives off the chain] in collective_engine/collectives.py): "all" (torch_xla's order), "gathers"
    # (reduce-scatters start from a fresh token: their input is the gradient itself; they still publish one, so what
    # follows waits for them), "off" (none waits)
    token_chain: str = "all"

    def __post_init__(self):
        for name, valid in (("reduce_scatter_stages", REDUCE_SCATTER_STAGES), ("all_gather_impl", ALL_GATHER_IMPLS),
                            ("token_chain", TOKEN_CHAINS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; use one of {valid}")
        if self.reduce_scatter_bucket_size_mb < 0:
            raise ValueError("reduce_scatter_bucket_size_mb must be >= 0 (0 means one bucket per unit)")


@dataclass(frozen=True)
class ReshardPolicy:
    """When gathered parameters are freed."""

    # free after forward and gather again for backward (FULL_SHARD); False keeps them from forward until the unit's
    # backward ends (SHARD_GRAD_OP)
    reshard_after_forward: bool = True
    # the root's backward starts right after its forward, so freeing it there only adds a gather
    disable_reshard_on_root: bool = True


@dataclass(frozen=True)
class ShardingLayout:
    """Who holds which shard. Ranks are global replica ordinals."""

    rank: int
    world_size: int
    # groups of ranks that split each parameter among themselves
    shard_groups: Tuple[Tuple[int, ...], ...]
    # groups of ranks holding the same shard (gradients are all-reduced across them)
    replicate_groups: Tuple[Tuple[int, ...], ...]

    def __post_init__(self):
        if not any(self.rank in g for g in self.shard_groups):
            raise ValueError(
                f"sharding_groups {list(map(list, self.shard_groups))} do not contain this rank "
                f"({self.rank}); every rank must belong to exactly one group"
            )
        sizes = {len(g) for g in self.shard_groups}
        if len(sizes) != 1:
            raise ValueError(f"sharding_groups must all have the same size, got sizes {sorted(sizes)}")
        flat = sorted(r for g in self.shard_groups for r in g)
        if flat != list(range(self.world_size)):
            raise ValueError(
                f"sharding_groups {list(map(list, self.shard_groups))} must partition ranks "
                f"0..{self.world_size - 1} exactly once each"
            )

    @property
    def shard_group(self) -> Tuple[int, ...]:
        return next(g for g in self.shard_groups if self.rank in g)

    @property
    def replicate_group(self) -> Tuple[int, ...]:
        return next(g for g in self.replicate_groups if self.rank in g)

    @property
    def shard_rank(self) -> int:
        return self.shard_group.index(self.rank)

    @property
    def shard_world_size(self) -> int:
        return len(self.shard_group)

    @property
    def replicate_world_size(self) -> int:
        return len(self.replicate_group)

    @classmethod
    def build(cls, rank: int, world_size: int, groups: Optional[Sequence[Sequence[int]]]) -> "ShardingLayout":
        if groups is None:
            groups = [list(range(world_size))]
        shard_groups = tuple(tuple(int(r) for r in g) for g in groups)
        if not shard_groups or not all(shard_groups):
            raise ValueError(f"sharding_groups={groups!r} must be a non-empty list of non-empty rank lists")
        size = min(len(g) for g in shard_groups)
        replicate_groups = tuple(tuple(g[i] for g in shard_groups) for i in range(size))
        return cls(rank, world_size, shard_groups, replicate_groups)


BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST")


@dataclass(frozen=True)
class PrefetchPolicy:
    """Which gathers start early, overlapping the previous unit's compute ([Note: prefetch])."""

    # gather the next unit (in the order units ran last step) tied to this unit's input
    forward: bool = True
    # in backward, gather the next unit tied to this unit's incoming gradient (BACKWARD_PRE) or to its reduced gradients
    # (BACKWARD_POST); None: each unit gathers when its gradient arrives
    backward: Optional[str] = "BACKWARD_PRE"

    def __post_init__(self):
        if self.backward is not None and self.backward not in BACKWARD_PREFETCH:
            raise ValueError(f"backward_prefetch={self.backward!r} is not valid; use one of "
                             f"{BACKWARD_PREFETCH} or None")

    @classmethod
    def parse(cls, forward, backward) -> "PrefetchPolicy":
        name = getattr(backward, "name", backward)  # torch.distributed.fsdp.BackwardPrefetch members too
        if isinstance(name, str):
            name = name.upper()
        return cls(bool(forward), name)


@dataclass(frozen=True)
class FSDPOptions:
    """Everything a unit needs to know, grouped by concern."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision
    collectives: CollectiveOptions
    reshard: ReshardPolicy
    # sync shard gradients at the end of backward (one execution, XLA only)
    sync_on_finalization: bool = False
    # run pending sharding work right away at construction (XLA only)
    execute_sharding_on_init: bool = True
    # single-controller runtime: which root inputs are batched (see manual_region.ManualRegion)
    is_batched_input: Optional[Callable[[str, torch.Tensor], bool]] = None
    prefetch: PrefetchPolicy = PrefetchPolicy()
    # the root's: the last this many checkpointed units (module order) keep their activations instead of recomputing
    # them ([Note: checkpoint all but the last] in activation_checkpoint.py); "fit": as many as the device's memory
    # holds ([Note: keep what fits] in memory/fit.py)
    checkpoint_all_but_last: Union[int, str] = 0

    def __post_init__(self):
        n = self.checkpoint_all_but_last
        if isinstance(n, str) and n.lower() == "fit":
            object.__setattr__(self, "checkpoint_all_but_last", "fit")
        elif isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"checkpoint_all_but_last={n!r} is not valid: give how many of the last "
                             "checkpointed units keep their activations, an int >= 0 (0: recompute all), "
                             "or \"fit\" (as many as the device's memory holds)")
