"""The libtpu flags xla_fsdp sets on a TPU: asynchronous all-gathers, within a memory budget, and random bits
drawn per chip.

libtpu 0.0.21 keeps every collective of our step synchronous on v4 unless told otherwise (v5e already overlaps
unpinned ones). Pinned collectives (`constrain_layout=true`, one process per chip) stay synchronous whatever the
flags; these act on the single controller's and the GSPMD engine's unpinned ones. Each was checked with libtpu's
compiler (tests/test_libtpu_flags.py; figures in docs/performance.md):
- `xla_enable_async_all_gather`, `xla_tpu_enable_async_collective_fusion_fuse_all_gather`: dropping either one
  leaves the tiny single-controller step on v4-8 with no asynchronous all-gather;
- `xla_tpu_scheduler_percent_shared_memory_limit`: the scheduler's memory budget (without it the 2B GPT-2 step on
  v4-8 does not fit), 50 for the single controller on at most 8 chips, whose rings peak far lower at 50 than at 70
  with the same overlap ([Note: rings by default on a TPU]), 90 for it on larger slices ([Note: the scheduler's
  budget on pods]), 70 otherwise (below 70 the all-gathers lose overlap). The launcher tells the slice's size in
  `environment.INTERNAL`'s `chips`; not told, 50 for the single controller;
- `xla_tpu_prefer_async_allgather_to_allreduce`: on v4 slices spanning all three torus axes (v4-128 and up)
  libtpu otherwise compiles every all-gather over the whole slice as a synchronous zero-padded all-reduce (twice
  the bytes). It changes nothing on v4-8 or v5e;
- `xla_tpu_spmd_rng_bit_generator_unsafe`: [Note: random bits per chip];
- on slices of more than 64 chips, the single controller's only: libtpu's asynchronous reduce-scatter fusion
  ([Note: asynchronous staged reduce-scatters]; tests/test_tpu_large_slice.py).
MaxText's `xla_tpu_overlap_compute_collective_tc`, `xla_enable_async_all_reduce` and, up to 64 chips,
`xla_tpu_enable_async_collective_fusion` and `..._multiple_steps` changed nothing in our programs (libtpu 0.0.21's
defaults already, or no all-reduce to overlap), so they are not set.

`import xla_fsdp` (so also `run_clm` and the Trainer integration) and the launcher (`launch/xla_spawn.py`, for the
processes it spawns) put them in `LIBTPU_INIT_ARGS` before libtpu starts, on a TPU only, and only when the user set
none of their own (theirs win, whole). The runtime is read from the environment (`environment.runtime`); flags
xla_fsdp set itself (marked in `environment.INTERNAL`) are re-decided when the runtime becomes known later, the
user's never. `python -m xla_fsdp.aot` compiles with the flags of the runtime it checks unless `--libtpu-flags` or
`LIBTPU_INIT_ARGS` says otherwise. With them goes `--logbuflevel=-1` (`at_start`), read only when libtpu starts:
libtpu writes each log line as it logs it instead of holding it in glog's buffer for up to 30 s, so the step's HBM
can be read from the log right after the first step ([Note: where the memory figures come from] in
memory/device_figures.py; [Note: the HBM a TPU program needs] in compile_log.py).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Mapping, MutableMapping, Optional

from ..runtime import environment
from ..runtime.choice import SINGLE_CONTROLLER

ENV = environment.LIBTPU_INIT_ARGS

ASYNC_COLLECTIVES: Mapping[str, str] = {
    "xla_enable_async_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_scheduler_percent_shared_memory_limit": "70",
    "xla_tpu_prefer_async_allgather_to_allreduce": "true",
}

# the single controller's: its rings under a tighter scheduler budget (see above)
SINGLE_CONTROLLER_COLLECTIVES: Mapping[str, str] = dict(
    ASYNC_COLLECTIVES, xla_tpu_scheduler_percent_shared_memory_limit="50")

# [Note: the scheduler's budget on pods]
# libtpu's scheduler overlaps a collective with compute only while the program's live memory stays under its
# budget (`xla_tpu_scheduler_percent_shared_memory_limit`). On pods the single controller keeps some blocks'
# activations (checkpoint_all_but_last "fit", [Note: keep what fits]), which lifts the backward's live memory above
# a 70% budget, and the scheduler then runs collectives with nothing beside them. At 90 more of the bytes run
# beside compute on the blog's pod pairs, for a slightly shorter PROJECTED step and a higher peak that still
# fits (measured: 0.86 -> 0.92 of the bytes beside compute on a 20B v4-128 with 14 of 43 blocks kept). So 90 for
# the single controller on slices of more than 8 chips (the rings of smaller ones keep 50, one process per chip 70).
POD_COLLECTIVES: Mapping[str, str] = dict(ASYNC_COLLECTIVES, xla_tpu_scheduler_percent_shared_memory_limit="90")

# [Note: random bits per chip]
# libtpu's SPMD partitioner replicates a random-bit generator (dropout's `bernoulli`) whatever its output's
# sharding: every chip draws the bits of the whole global batch and keeps its slice (the 64B GPT-2 on v4-256: two
# 9 GiB buffers per chip, and the scanned step lost all its asynchronous all-gathers). With this flag each chip
# draws only its tile's bits, from the generator's state offset by a per-tile constant: chips holding the same tile
# (a partially replicated sharding) draw the same bits, so replicas stay equal (tests/test_libtpu_flags.py compiles
# both cases). "Unsafe" in libtpu's name: the bits differ from the unpartitioned program's, and with the sharding;
# dropout and on-device random initialization need random bits, not those ones. A flag of the partitioner: it
# changes nothing for one process per chip.
PARTITIONED_RANDOM_BITS: Mapping[str, str] = {"xla_tpu_spmd_rng_bit_generator_unsafe": "true"}

# [Note: asynchronous staged reduce-scatters]
# On 3-D slices of more than 64 chips the single controller reduce-scatters in stages, one per torus axis ([Note:
# one reduce-scatter per torus axis]), and libtpu 0.0.21 keeps every stage synchronous by default. libtpu's async
# reduce-scatter fusion (`..._fuse_reduce_scatter` with `xla_enable_async_reduce_scatter_fusion`, as MaxText enables
# it; either alone changes nothing) runs part of them beside compute. `..._with_start_done_only` keeps it from
# fusing a weight-gradient matmul into the collective, which overflows v4's 16 MiB of VMEM. `..._fuse_kloop_fusions`
# also fuses the elementwise producer of a collective's input (torch_xla's token add, a relayout) into the
# asynchronous collective, which otherwise stays synchronous. Measured on the blog's 64B on v4-256: asynchronous
# bytes 0.45 -> 0.65 and a 3.3% shorter PROJECTED step, for a longer compile (231 -> 319 s); on v6e-256 (Llama 3 8B,
# staged too: [Note: staged on 2-D slices]) about the same step. So: the single controller on slices of more than
# 64 chips, 3-D or 2-D alike (the flags are chosen by the slice's chip count; its shape is not known here). With
# token_chain "off" ([Note: collectives off the chain] in collective_engine/collectives.py) the Llama step's
# reduce-scatters run beside compute too.
ASYNC_REDUCE_SCATTERS: Mapping[str, str] = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": "true",
    "xla_enable_async_reduce_scatter_fusion": "true",
    "xla_tpu_async_collective_fusion_with_start_done_only": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions": "true",
}
# slices above this many chips keep staged reduce-scatters (collective_engine/auto.py's SCATTER_RING_MAX_CHIPS)
STAGED_ABOVE_CHIPS = 64

# INTERNAL's "libtpu_set": what xla_fsdp itself put in LIBTPU_INIT_ARGS; its "chips": the whole
# slice's, when the launcher knows them
MARK = CHIPS_ENV = environment.INTERNAL
# the largest slice on which the single controller's "auto" makes rings ([Note: rings by default on a TPU])
RING_MAX_CHIPS = 8
# "0": all-gathers and staged reduce-scatters where "auto" would ring, at 70% ([Note: rings off for the last GiB])
RINGS_ENV = environment.RINGS

UNBUFFERED_LOG = "--logbuflevel=-1"  # a start-up flag (see above): never in a compile's flags


def at_start(args: str) -> str:
    """`args` as xla_fsdp puts them in LIBTPU_INIT_ARGS: with libtpu's log unbuffered."""
    return f"{args} {UNBUFFERED_LOG}"


def init_args(flags: Mapping[str, str] = ASYNC_COLLECTIVES) -> str:
    """`flags` spelled as LIBTPU_INIT_ARGS ("--name=value ...")."""
    return " ".join(f"--{k}={v}" for k, v in flags.items())


DEFAULT_INIT_ARGS = init_args({**ASYNC_COLLECTIVES, **PARTITIONED_RANDOM_BITS})  # one process per chip, and a runtime not yet known
POD_GATHERS_INIT_ARGS = init_args({**POD_COLLECTIVES, **PARTITIONED_RANDOM_BITS})  # the single controller, 9-64 chips
POD_INIT_ARGS = init_args({**POD_COLLECTIVES, **PARTITIONED_RANDOM_BITS, **ASYNC_REDUCE_SCATTERS})
SINGLE_CONTROLLER_INIT_ARGS = init_args({**SINGLE_CONTROLLER_COLLECTIVES, **PARTITIONED_RANDOM_BITS})


def rings_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """False when the rings variable (RINGS_ENV) turns the single controller's rings off.

    [Note: rings off for the last GiB]
    The rings under the 50% budget peak lower than the gathers at the blog's batches, but at the edge of HBM, where
    the sharded state fills the chip, they need a little more (GPT-2 16B on v4-8 at 1 x 1024 per chip: 30.82 GiB of
    the 30.75 usable with rings; it fits with all-gathers at 70%; docs/performance.md). RINGS_ENV=0 is that
    configuration in one switch: "auto" keeps the gathers and staged reduce-scatters, and the launcher, `import
    xla_fsdp` and `python -m xla_fsdp.aot` give libtpu the gathers' 70% budget. The check tries it by itself when
    the default does not fit (xla_fsdp/aot/cli.py). On pods it also keeps the staged reduce-scatters where "auto"
    would ring them ([Note: reduce-scatter rings on pods] in collective_engine/auto.py)."""
    value = environment.get(RINGS_ENV, environ).lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{RINGS_ENV}={environment.get(RINGS_ENV, environ)!r}: expected 0 (all-gathers and staged reduce-scatters "
                     f"under the 70% libtpu budget) or 1 (rings on slices of up to {RING_MAX_CHIPS} chips and reduce-scatter "
                     f"rings on v4/v5p slices of up to 64 chips, the default)")


def for_runtime(runtime: Optional[str], chips: Optional[int] = None,
                environ: Mapping[str, str] = os.environ) -> str:
    """xla_fsdp's LIBTPU_INIT_ARGS for `runtime` ("single_controller", "multi_process", None) on `chips` (None:
    unknown): the rings' budget where the single controller rings, the pods' on larger slices, else the gathers'."""
    rings = (runtime == SINGLE_CONTROLLER and (chips is None or chips <= RING_MAX_CHIPS)
             and rings_enabled(environ))
    if rings:
        return SINGLE_CONTROLLER_INIT_ARGS
    if runtime == SINGLE_CONTROLLER and chips is not None and chips > STAGED_ABOVE_CHIPS:
        return POD_INIT_ARGS  # [Note: asynchronous staged reduce-scatters]
    if runtime == SINGLE_CONTROLLER and chips is not None and chips > RING_MAX_CHIPS:
        return POD_GATHERS_INIT_ARGS  # [Note: the scheduler's budget on pods]
    return DEFAULT_INIT_ARGS


def users_own(environ: Mapping[str, str] = os.environ) -> str:
    """The LIBTPU_INIT_ARGS the user set, or "" (none, or the flags xla_fsdp set itself)."""
    current = environment.get(ENV, environ)
    return "" if current == environment.internal(environ).get("libtpu_set", "").strip() else current


def chips_of(environ: Mapping[str, str]) -> Optional[int]:
    chips = environment.internal(environ).get("chips")
    return chips if isinstance(chips, int) and chips > 0 else None


def runtime_of(environ: Mapping[str, str]) -> Optional[str]:
    """The runtime the environment declares; None for a value that is none (the launcher and the job refuse it)."""
    try:
        return environment.runtime(environ)
    except ValueError:
        return None


def on_tpu(environ: Mapping[str, str] = os.environ) -> bool:
    return environment.get(environment.PJRT_DEVICE, environ).upper() == "TPU"


def _runtime_started() -> bool:
    xla = sys.modules.get("torch_xla")  # not imported: nothing can have started libtpu
    return xla is not None and bool(xla._XLAC._xla_runtime_is_initialized())


def set_defaults(environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """On a TPU, set LIBTPU_INIT_ARGS to the async-collective flags unless the user set it; returns what it set (None:
    left alone). libtpu reads them once, when the XLA runtime starts: if it already has, warn with the export to use."""
    ours = bool(environment.get(ENV, environ)) and not users_own(environ)
    if not on_tpu(environ) or users_own(environ):
        return None
    wanted = at_start(for_runtime(runtime_of(environ), chips_of(environ), environ))
    if environ is os.environ and _runtime_started():
        if not ours:
            warnings.warn(f"xla_fsdp: the XLA runtime started before xla_fsdp was imported, so libtpu runs "
                          f"without the async-collective flags (collectives stay synchronous on v4). Import "
                          f"xla_fsdp before touching an XLA device, or export {ENV}='{wanted}'",
                          stacklevel=3)
        return None
    environ[ENV] = wanted
    environ[MARK] = environment.with_internal(environ, libtpu_set=wanted)
    return wanted
