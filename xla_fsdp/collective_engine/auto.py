"""What `all_gather_impl="auto"` and `reduce_scatter_stages="auto"` mean for one engine
([Note: rings by default on a TPU]).

[Note: rings by default on a TPU]
Compiled by libtpu 0.0.21 for the blog's 2B GPT-2 on v4-8 (32 x 1024 per chip, per-layer
checkpointing; docs/performance.md), the single controller's all-gathers and staged
reduce-scatters leave half the collective bytes synchronous: libtpu never runs our
reduce-scatters asynchronously and keeps 149 of 257 gathers synchronous (0.48 of the bytes
asynchronous). The same step with gathers and reduce-scatters as rings of collective-permutes
([Note: ring reduce-scatter]) sends the same bytes, 0.96 of them asynchronously with compute
between start and done, and, under a 50% scheduler memory budget (xla_fsdp.tpu.libtpu_flags,
set for the single controller), peaks at 21.79 GiB per chip instead of 23.05 at the same
projected step. So "auto" means rings where they apply:
- the single controller (one program for every device; pinned per-process collectives are
  never asynchronous anyway, and a ring needs the partitioner's permutes);
- a TPU, or the ahead-of-time check compiling for one (on XLA:CPU, where nothing is
  asynchronous, the gathers and reduce-scatters stay: they are what the CPU parity runs test);
- one shard group holding every device in id order (FULL_SHARD, SHARD_GRAD_OP; not
  HYBRID_SHARD or sharding groups), over more than one device;
- a slice of at most libtpu_flags.RING_MAX_CHIPS (8) chips: the slices where the rings were compiled and
  projected at no step-time cost (2B v4-8 3.703 s against the gathers' 3.698; 125M v5e-8 0.294
  against 0.287, v6e-8 0.495 against 0.496). On the blog's 16B on v4-64 (32 chips, 2x4x4) the
  rings fit (23.57 GiB against 24.13) with 0.76 of the bytes beside compute, but their chunk
  additions and concatenations add 0.50 s of compute (11.58 s against 11.08) and the step projects
  at 12.25 s against the gathers' 11.63 s; 20B on v4-128 (64 chips): 21.32 GiB against 14.38,
  8.18 s against 7.75 s. So pods keep the gathers;
- both "auto" (or the other one "ring"): a ring only for the reduce-scatters was measured to
  cost more HBM than it hides at 2B (30.07 GiB), so an explicit `all_gather_impl="all_gather"`
  keeps the staged reduce-scatters too.
- the rings variable (`environment.RINGS`) not "0" (the switch for models at the edge of HBM, where the gathers at 70% fit
  and the rings at 50% do not: [Note: rings off for the last GiB], xla_fsdp.tpu.libtpu_flags).
On slices of 9 to 64 chips "auto" rings the reduce-scatters only ([Note: reduce-scatter rings on
pods]). Everywhere else "auto" is the native all-gather and, for the reduce-scatter, "axes": one
reduce-scatter per torus axis on v4/v5p slices ([Note: one reduce-scatter per torus axis]).

[Note: reduce-scatter rings on pods]
On slices of more than RING_MAX_CHIPS chips every staged reduce-scatter stays synchronous (a
third of the collective bytes: the blog's 16B on v4-64, 47 of 47 in a 4-layer copy), and the
gather rings cost compute and HBM (above). Ringing only the reduce-scatters, one ring per torus
axis, makes those bytes collective-permutes that libtpu runs beside compute, while the gathers
stay all-gathers under the 70% budget. Compiled for v4-64 (4-layer copy of the 16B, 16 x 1024
per chip, kernel; 2026-11-28): async bytes 0.81 against 0.44, compute +0.8%, peak 6.43 GiB
against 7.31, projected 0.786 s against 0.802. At full depth with prefetch on (the shipped config), the
bytes beside compute went from 0.48-0.50 to 0.92-0.99 and the projected steps fell 3-6% on
16B v4-64, 20B and 32B v4-128; HBM rose (16B: 24.06 GiB against 17.51) as libtpu's 70%
scheduler budget lets the asynchronous permutes and gathers overlap more. The rows are in
docs/performance.md (the blog's table, compiled). On v4-256 (128 chips) libtpu's compile of
the 64B step with the rings outgrew this host's 24 GB (killed at 23.9 GB after 1,076 s; with
the staged reduce-scatters it compiled in 298 s), so nothing above 64 chips was measured and
slices of more than SCATTER_RING_MAX_CHIPS keep the staged reduce-scatters (an explicit
reduce_scatter_stages="ring" still rings them). Their staged reduce-scatters get libtpu's
asynchronous reduce-scatter fusion instead ([Note: asynchronous staged reduce-scatters] in
tpu/libtpu_flags.py). Applied where the slice's torus shape is known (torus.slice_shape(): the
check sets it; on a TPU the runtime's coordinates), with one shard group of every device in id
order, on the single controller on a TPU, unless the rings variable is 0.
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
    """Shard groups a ring can run over: one group of every device in id order, or one per slice
    of a multislice job (never a ring across slices, nor a user's sharding groups)."""
    return len(shard_groups) == environment.num_slices() and consecutive_blocks(shard_groups, num_devices)


def consecutive_blocks(shard_groups: Sequence[Sequence[int]], num_devices: int) -> bool:
    """The groups are consecutive blocks of device ids in order, of one size, covering every device
    (one group of every device, or HSDP's one group per slice)."""
    if not shard_groups or num_devices % len(shard_groups):
        return False
    k = num_devices // len(shard_groups)
    return [list(g) for g in shard_groups] == [list(range(i * k, (i + 1) * k)) for i in range(len(shard_groups))]


# the largest slice whose reduce-scatter rings were compiled and measured ([Note: reduce-scatter
# rings on pods]): v4-128's 64 chips; on v4-256 the 64B step's compile ran out of this host's 24 GB
SCATTER_RING_MAX_CHIPS = libtpu_flags.STAGED_ABOVE_CHIPS


def scatter_rings_apply(shard_groups: Sequence[Sequence[int]], num_devices: int, torus_known: bool) -> bool:
    """One shard group of every device in id order, over more than RING_MAX_CHIPS and at most
    SCATTER_RING_MAX_CHIPS devices of a slice whose torus shape is known ([Note: reduce-scatter rings on pods])."""
    return (torus_known and libtpu_flags.RING_MAX_CHIPS < num_devices <= SCATTER_RING_MAX_CHIPS
            and [list(g) for g in shard_groups] == [list(range(num_devices))])


def resolve(options: CollectiveOptions, single_controller: bool, rings_possible: bool = False,
            on_tpu: bool = False, rings_enabled: bool = True,
            scatter_rings_possible: bool = False) -> CollectiveOptions:
    """`options` with "auto" replaced by what runs ([Note: rings by default on a TPU]);
    `rings_enabled` False (the rings variable 0: [Note: rings off for the last GiB]) keeps the gathers;
    `scatter_rings_possible`: a pod where the reduce-scatters ring ([Note: reduce-scatter rings on
    pods])."""
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
