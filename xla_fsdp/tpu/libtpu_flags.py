"""The libtpu flags xla_fsdp sets on a TPU: asynchronous all-gathers, within a memory budget, and
random bits drawn per chip.

libtpu 0.0.21 keeps every collective of our step synchronous on v4 unless
told otherwise (v5e already overlaps unpinned ones by default). Pinned
collectives (`constrain_layout=true`, the one-process-per-chip runtime) stay
synchronous whatever the flags; these act on the single controller's and
the GSPMD engine's unpinned ones.

Each flag was checked with libtpu's compiler (tests/test_libtpu_flags.py):
- `xla_enable_async_all_gather`, `xla_tpu_enable_async_collective_fusion_fuse_all_gather`:
  dropping either one leaves the tiny single-controller step on v4-8 with no
  asynchronous all-gather;
- `xla_tpu_scheduler_percent_shared_memory_limit`: the scheduler's memory
  budget, 50 for the single controller on a slice of at most 8 chips (whose
  gathers and reduce-scatters are rings by default: [Note: rings by default
  on a TPU]), 90 for it on larger slices ([Note: the scheduler's budget on
  pods]) and 70 otherwise (the launcher tells the slice's size in
  `environment.INTERNAL`'s `chips`; not told, 50 for the single controller). The
  2B step of the single controller with rings on v4-8, compiled: 28.57 GiB
  at 70, 21.79 GiB at 50 with the same overlap (0.96 of the bytes
  asynchronous beside compute) and projected step (3.699 / 3.703 s). At 70,
  the budget (it also moves random-bit generation for dropout ahead of
  its use, 3 GiB per layer at 2B). The 2B GPT-2 step (32x1024, per-layer
  checkpointing, async all-gathers) on v4-8, compiled: without the flag it
  does not fit (31.6 GiB of 30.75 usable); at 80: 27.56 GiB; at 70: 24.66
  GiB; at 60: 24.30 GiB, but 81 instead of 125 all-gathers asynchronous and
  a longer projected step (3.721 s against 3.707 s at 70 and 80) (those
  with all-gathers and staged reduce-scatters, the single controller's
  collectives before the rings and still where rings do not apply);
- `xla_tpu_prefer_async_allgather_to_allreduce`: on v4 slices whose chips
  span all three torus axes (v4-128: 4x4x4) libtpu otherwise compiles every
  all-gather over the whole slice as a zero-padded all-reduce (twice the
  bytes, synchronous). GPT-2 125M on v4-128: 189 synchronous all-reduces
  without it; with it 49 of 98 all-gathers asynchronous beside matmuls (as
  on v4-32, where the gathers stay gathers without it). It changes nothing
  on v4-8 or v5e.
- `xla_tpu_spmd_rng_bit_generator_unsafe`: without it the SPMD partitioner
  draws every random-bit generator at its global shape on every chip and
  slices its part ([Note: random bits per chip]).
- on slices of more than 64 chips, the single controller's only: libtpu's asynchronous
  reduce-scatter fusion for the staged reduce-scatters there ([Note: asynchronous staged
  reduce-scatters] below; tests/test_tpu_large_slice.py).
Flags measured to change nothing in our programs are not set
(`xla_tpu_enable_async_collective_fusion`, `..._multiple_steps`,
`xla_tpu_overlap_compute_collective_tc`, `xla_enable_async_all_reduce`:
libtpu 0.0.21's defaults already, or no all-reduce it could overlap).

`import xla_fsdp` (so also `run_clm` and the Hugging Face Trainer
integration) and the launcher (`launch/xla_spawn.py`, for the processes it
spawns) put them in `LIBTPU_INIT_ARGS` before libtpu starts, on a TPU only, and only when the user set no
`LIBTPU_INIT_ARGS` of their own (theirs win, whole). The runtime is read from
the environment (`environment.runtime`: the launcher sets it before it sets the flags, or
torch_xla's SPMD variable); flags xla_fsdp set itself (marked in `environment.INTERNAL`) are
re-decided when the runtime becomes known later, the user's never. `python -m
xla_fsdp.aot` compiles with the flags of the runtime it checks unless `--libtpu-flags` or
`LIBTPU_INIT_ARGS` says otherwise.

With them goes one flag libtpu reads only when it starts, never a compile option:
`--logbuflevel=-1` (`at_start`), so libtpu writes its log's lines as it logs them instead of
holding them in glog's buffer for up to 30 s. Keeping what fits under the single controller
reads the step's HBM from that log right after the first step ([Note: where the memory figures
come from] in xla_fsdp/memory/device_figures.py), and a long compile's last lines could still be
in the buffer then (seen in the check, [Note: the HBM a TPU program needs] in compile_log.py).
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
# libtpu's scheduler overlaps a collective with compute only while the program's live memory stays
# under its budget (`xla_tpu_scheduler_percent_shared_memory_limit`). On pods the single controller
# keeps some blocks' activations (checkpoint_all_but_last "fit", [Note: keep what fits]), which
# lifts the live memory of the backward above a 70% budget, and the scheduler then runs
# collectives with nothing beside them. Compiled for the blog's pairs (libtpu 0.0.21 deviceless,
# kernel, 2026-11-29; share of collective bytes with compute beside them, PROJECTED step, peak
# HBM; budget 70 -> 90): 20B v4-128 with 14 of 43 blocks kept 0.86 -> 0.92, 5.275 -> 5.255 s,
# 23.09 -> 27.07 GiB; 32B v4-128 with 7 of 39 kept 0.92 -> 0.97, 8.349 -> 8.301 s, 22.26 -> 28.00
# GiB; 128B v4-512 with 10 of 70 kept 0.82 -> 0.86, 17.993 -> 17.869 s, 28.91 -> 29.43 GiB. Every
# block recomputed: 16B v4-64 0.92 -> 0.96, 8.423 -> 8.378 s, 21.84 -> 23.24 GiB; 20B 0.99 either
# way, 5.480 -> 5.471 s. Llama 3 8B on v6e-256 (every layer recomputed): 3.491 -> 3.488 s, 25.57 ->
# 26.19 GiB. So 90 for the single controller on slices of more than 8 chips (the rings of smaller
# ones keep 50, one process per chip keeps 70).
POD_COLLECTIVES: Mapping[str, str] = dict(ASYNC_COLLECTIVES, xla_tpu_scheduler_percent_shared_memory_limit="90")

# [Note: random bits per chip]
# libtpu's SPMD partitioner replicates a random-bit generator (dropout's `bernoulli`) whatever
# its output's sharding: every chip draws the bits of the whole global batch and keeps its
# slice. On the 64B GPT-2 for v4-256 (8 x 1024 per chip, 128 chips) the embedding dropout drew
# two u8[1024, 1024, 9216] buffers, 9 GiB each, on every chip, and the scanned step lost all its
# asynchronous all-gathers (async share of collective bytes 0.00 against 0.52). With this flag
# each chip draws only its tile's bits (u8[8, 1024, 9216] there), from the generator's state
# offset by a per-tile constant: chips holding the same tile (a partially replicated sharding)
# draw the same bits, so replicas stay equal (tests/test_libtpu_flags.py compiles both cases).
# "Unsafe" in libtpu's name: the bits differ from the unpartitioned program's, and with the
# sharding; dropout and on-device random initialization need random bits, not those ones.
# A flag of the partitioner: it changes nothing for one process per chip.
PARTITIONED_RANDOM_BITS: Mapping[str, str] = {"xla_tpu_spmd_rng_bit_generator_unsafe": "true"}

# [Note: asynchronous staged reduce-scatters]
# On 3-D slices of more than 64 chips the single controller reduce-scatters in stages, one per
# torus axis ([Note: one reduce-scatter per torus axis]; the reduce-scatter rings of smaller pods
# did not compile there in this host's 24 GB), and libtpu 0.0.21 keeps every stage synchronous
# by default. With libtpu's async reduce-scatter fusion (`..._fuse_reduce_scatter` and
# `xla_enable_async_reduce_scatter_fusion`, as MaxText enables it) it runs part of them beside
# compute; without `xla_tpu_async_collective_fusion_with_start_done_only` it also fuses a
# weight-gradient matmul into the collective and runs out of v4's 16 MiB of VMEM (the 64B
# GPT-2 on v4-256: 16.42 of 16.00 MiB). Compiled for v4-256 (the blog's 64B, 8 x 1024 per chip,
# kernel, shipped config; libtpu 0.0.21 deviceless, 2026-11-29): asynchronous bytes 0.45 -> 0.65,
# PROJECTED step 17.623 -> 17.049 s (-3.3%), peak HBM 23.79 -> 23.77 GiB, but libtpu's compile
# 231 -> 319 s. Either alone, or with start/done only and no reduce-scatter fusion, changes
# nothing. On v6e-256 (Llama 3 8B, staged too: [Note: staged on 2-D slices]) it changes nothing
# at full depth (3.493 s against 3.491). So: the single controller, slices of more than 64 chips,
# 3-D or 2-D alike (the flags are chosen by the slice's chip count; its shape is not known here).
# With `xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions` libtpu also fuses the
# elementwise producer of a collective's input (torch_xla's token add, a relayout) into the
# asynchronous collective, where without it the collective stays synchronous: Llama 3 8B on
# v6e-256 (full depth, 2026-11-29) 3.488 -> 3.477 s; a 3-block copy of the 128B on v4-512
# asynchronous bytes 0.80 -> 0.91, every gather of the step's start asynchronous, 0.873 -> 0.871
# s, peak unchanged; with token_chain "off" ([Note: collectives off the chain] in
# collective_engine/collectives.py) the Llama step's reduce-scatters run beside compute too.
ASYNC_REDUCE_SCATTERS: Mapping[str, str] = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": "true",
    "xla_enable_async_reduce_scatter_fusion": "true",
    "xla_tpu_async_collective_fusion_with_start_done_only": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions": "true",
}
# slices above this many chips keep staged reduce-scatters (collective_engine/auto.py's
# SCATTER_RING_MAX_CHIPS, which imports this module)
STAGED_ABOVE_CHIPS = 64

# INTERNAL's "libtpu_set": what xla_fsdp itself put in LIBTPU_INIT_ARGS; its "chips": the whole
# slice's, when the launcher knows them
MARK = CHIPS_ENV = environment.INTERNAL
# the largest slice on which the single controller's "auto" makes rings (collective_engine/auto.py,
# [Note: rings by default on a TPU]); larger slices keep the gathers and their budget
RING_MAX_CHIPS = 8
# "0": the single controller keeps all-gathers and staged reduce-scatters where "auto" would make
# rings, under their 70% budget ([Note: rings off for the last GiB])
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
    The rings under the 50% budget peak lower than the gathers at the blog's batches (2B v4-8:
    21.79 GiB against 23.05), but at the edge of HBM, where the sharded state fills the chip, they
    need a little more: GPT-2 16B on v4-8 at 1 x 1024 per chip, compiled by libtpu 0.0.21, needs
    30.82 GiB of the 30.75 libtpu can use with rings at 50% and fits with all-gathers at 70%
    (31.04 by our count; libtpu compiled it). RINGS_ENV=0 is that configuration in one switch:
    "auto" keeps the gathers and staged reduce-scatters, and the launcher, `import xla_fsdp` and
    `python -m xla_fsdp.aot` give libtpu the gathers' 70% budget. The check tries it by itself
    when the default does not fit (xla_fsdp/aot/cli.py). On pods it also keeps the staged
    reduce-scatters where "auto" would ring them ([Note: reduce-scatter rings on pods] in
    collective_engine/auto.py); on 16B v4-64 the rings peak at 24.06 GiB where the staged
    reduce-scatters (prefetch off) peaked at 17.51."""
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
    """xla_fsdp's LIBTPU_INIT_ARGS for `runtime` ("single_controller", "multi_process", None) on a
    slice of `chips` (None: not known): the rings' budget where the single controller makes rings
    ([Note: rings by default on a TPU]), the pods' on larger slices ([Note: the scheduler's budget on
    pods]), the gathers' elsewhere and under RINGS_ENV=0."""
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
    """The runtime the environment declares (`environment.runtime`); None for a value that is no
    runtime (the launcher and the job refuse it by name, not this module's import)."""
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
    """On a TPU, set LIBTPU_INIT_ARGS to the async-collective flags unless the user set it;
    returns what it set (None when it left the environment alone). libtpu reads them once,
    when the XLA runtime starts: if it has started already, warn with the export to use."""
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
