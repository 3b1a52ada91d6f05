"""What `all_gather_impl="auto"` and `reduce_scatter_stages="auto"` mean for one engine.

[Note: rings by default on a TPU]
libtpu runs few of the single controller's all-gathers and none of its staged reduce-scatters asynchronously;
gathers and reduce-scatters as rings of collective-permutes ([Note: ring reduce-scatter]) send the same bytes
beside compute and, under the single controller's 50% scheduler budget (xla_fsdp.tpu.libtpu_flags), peak lower
(measured: 2B GPT-2 on v4-8, 0.48 -> 0.96 of the bytes asynchronous, 23.05 -> 21.79 GiB per chip; figures in
docs/performance.md). So "auto" means rings where all of these hold:
- the single controller (pinned per-process collectives are never asynchronous, and a ring needs the
  partitioner's permutes);
- a TPU, or the ahead-of-time check compiling for one (XLA:CPU runs nothing asynchronously, and the CPU parity
  runs test the gathers and reduce-scatters);
- one shard group of every device in id order (not HYBRID_SHARD or sharding groups), over more than one device;
- a slice of at most libtpu_flags.RING_MAX_CHIPS (8) chips: on pods the rings' chunk additions and
  concatenations cost more compute than they hide (16B on v4-64: 12.25 s projected against the gathers' 11.63 s);
- both "auto" (or the other one "ring"): ringing only the reduce-scatters cost more HBM than it hid at 2B, so an
  explicit `all_gather_impl="all_gather"` keeps the staged reduce-scatters too;
- the rings variable (`environment.RINGS`) not "0", the switch for models at the edge of HBM where the gathers
  at 70% fit and the rings at 50% do not ([Note: rings off for the last GiB], xla_fsdp.tpu.libtpu_flags).
On slices of 9 to 64 chips "auto" rings the reduce-scatters only ([Note: reduce-scatter rings on pods]).
Everywhere else "auto" is the native all-gather and "axes": one reduce-scatter per torus axis on v4/v5p slices
([Note: one reduce-scatter per torus axis]).

[Note: reduce-scatter rings on pods]
On slices of more than RING_MAX_CHIPS chips every staged reduce-scatter stays synchronous (a third of the
collective bytes) and gather rings cost compute and HBM (above). Ringing only the reduce-scatters, one ring per
torus axis, makes those bytes permutes libtpu runs beside compute while the gathers stay all-gathers under the 70%
budget (measured at full depth: 0.48-0.50 -> 0.92-0.99 of the bytes beside compute, steps 3-6% shorter on 16B
v4-64 and 20B/32B v4-128, HBM higher; rows in docs/performance.md). Nothing above 64 chips was measured (the 64B
v4-256 compile with the rings outgrew the host's memory), so slices of more than SCATTER_RING_MAX_CHIPS keep the
staged reduce-scatters (an explicit reduce_scatter_stages="ring" still rings them) under libtpu's asynchronous
reduce-scatter fusion ([Note: asynchronous staged reduce-scatters] in tpu/libtpu_flags.py). Applied where the
slice's torus shape is known (torus.slice_shape(): the check sets it; on a TPU the runtime's coordinates), with
one shard group of every device in id order, on the single controller on a TPU, unless the rings variable is 0.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Mapping, Sequence

from ..abstract import tpu_target  # noqa: F401 - the engine's callers read it here
from ..runtime import environment
from ..options import CollectiveOptions
from ..tpu import libtpu_flags


def rings_apply(shard_groups: Sequence[Sequence[int]], num_devices: int) -> bool:
    """One shard group of every device in id order, over 2 to RING_MAX_CHIPS devices; or, on a
    job of several slices, one such group per slice ([Note: rings within each slice] in ring.py)."""
    return ring_groups(shard_groups, num_devices) and 1 < len(shard_groups[0]) <= libtpu_flags.RING_MAX_CHIPS


def ring_groups(shard_groups: Sequence[Sequence[int]], num_devices: int) -> bool:
    """Shard groups a ring can run over: consecutive blocks of device ids in order, of one size, covering every device,
    one per slice (one group of every device, or a multislice job's HSDP groups; never a ring across slices, nor a
    user's sharding groups)."""
    n = len(shard_groups)
    if n != environment.num_slices() or num_devices % n:
        return False
    k = num_devices // n
    return [list(g) for g in shard_groups] == [list(range(i * k, (i + 1) * k)) for i in range(n)]


# the largest slice whose reduce-scatter rings were measured (v4-128's 64 chips; [Note: reduce-scatter rings on pods])
SCATTER_RING_MAX_CHIPS = libtpu_flags.STAGED_ABOVE_CHIPS


def scatter_rings_apply(shard_groups: Sequence[Sequence[int]], num_devices: int, torus_known: bool) -> bool:
    """One shard group of every device in id order, over more than RING_MAX_CHIPS and at most
    SCATTER_RING_MAX_CHIPS devices of a slice whose torus shape is known ([Note: reduce-scatter rings on pods])."""
    return (torus_known and libtpu_flags.RING_MAX_CHIPS < num_devices <= SCATTER_RING_MAX_CHIPS
            and [list(g) for g in shard_groups] == [list(range(num_devices))])


def resolve(options: CollectiveOptions, single_controller: bool, rings_possible: bool = False,
            on_tpu: bool = False, rings_enabled: bool = True,
            scatter_rings_possible: bool = False) -> CollectiveOptions:
    """`options` with "auto" replaced by what runs ([Note: rings by default on a TPU]); `rings_enabled` False (the rings
    variable 0: [Note: rings off for the last GiB]) keeps the gathers; `scatter_rings_possible`: a pod where the
    reduce-scatters ring ([Note: reduce-scatter rings on pods])."""
    gather, scatter = options.all_gather_impl, options.reduce_scatter_stages
    if gather != "auto" and scatter != "auto":
        return options
    asked = (gather, scatter) in (("auto", "ring"), ("ring", "auto"))  # the other one a ring too
    rings = single_controller and rings_possible and on_tpu and (
        asked or ((gather, scatter) == ("auto", "auto") and rings_enabled))
    scatter_ring = rings or (single_controller and scatter_rings_possible and on_tpu and rings_enabled
                             and gather in ("auto", "all_gather"))
    return dataclasses.replace(
        options,
        all_gather_impl=("ring" if rings else "all_gather") if gather == "auto" else gather,
        reduce_scatter_stages=("ring" if scatter_ring else "axes") if scatter == "auto" else scatter)


def warn_if_budget_is_not_the_rings(environ: Mapping[str, str] = os.environ) -> bool:
    """Rings chosen on a TPU whose libtpu started with xla_fsdp's flags for one process per chip
    (70% budget: a script that calls `torch_xla.runtime.use_spmd()` itself, without the launcher
    or the runtime variable): say how to get the single controller's. True when it warned."""
    per_chip = (libtpu_flags.DEFAULT_INIT_ARGS, libtpu_flags.at_start(libtpu_flags.DEFAULT_INIT_ARGS))
    if environment.aot(environ).get("trace") or environment.get(libtpu_flags.ENV, environ) not in per_chip:
        return False
    warnings.warn(f"xla_fsdp: the single controller gathers and reduce-scatters by rings on this TPU, but "
                  f"libtpu started with the one-process-per-chip flags (scheduler budget 70%), under which "
                  f"the rings need more HBM (2B GPT-2 on v4-8: 28.57 GiB per chip instead of 21.79). Export "
                  f"{environment.RUNTIME}={libtpu_flags.SINGLE_CONTROLLER} before importing xla_fsdp, or "
                  f"launch with launch/xla_spawn.py", stacklevel=4)
    return True
