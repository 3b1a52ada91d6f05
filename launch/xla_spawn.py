"""Launch a training script on XLA devices (PJRT runtime).

Usage (compatible with the Hugging Face / torch_xla ``xla_spawn.py``)::

    python launch/xla_spawn.py [--num_cores N] [--spmd | --per_chip] path/to/train.py --its --own --flags

Launcher flags come before the script path; everything after it reaches the
script untouched (even ``--num_cores`` or ``--help``), with
``sys.argv == [script_path, *script_args]``. Two kinds of script:

- Hugging Face's convention: the script is imported by path and its
  ``_mp_fn(index)`` is called once per replica.
- torch_xla's: the script starts itself, ``if __name__ == "__main__":
  xmp.spawn(_mp_fn, args=(FLAGS,))`` (or ``torch_xla.launch``). Its own
  ``__main__`` runs, with its own arguments, and its call is routed to the
  runtime chosen below: ``fn(index, *args)`` as torch_xla calls it
  (xla_fsdp/runtime/self_starting.py). An ``fn`` that cannot take the index and
  ``args`` is refused by name.
- A plain script (torchrun-style: no ``_mp_fn``, ``if __name__ == "__main__":
  main()``, as FSDP2 scripts are) under the single controller, or at
  ``--num_cores 1`` when it declares the single controller (an FSDP2 script
  does by importing ``xla_fsdp.fsdp``): it runs once, as ``python script.py``
  would. One process per chip needs ``_mp_fn``.

What runs where (the world is what ``xr.world_size()`` says in the script):

============  ==============  ================================================
device        --num_cores     behaviour
============  ==============  ================================================
any           1               one replica in this process, world 1
CPU           2..64           only the single controller (below), and only when
                              chosen: ``--spmd``, the runtime variable or the
                              script's runtime line (both: docs/environment.md)
                              saying ``single_controller``; anything else is refused,
                              exit 2 (one process per CPU device would hang)
TPU           every local     ``xmp.spawn``: one process per chip, world N,
              device          unless the script's runtime line declares
                              ``single_controller`` (``launch/run_clm.py``'s does):
                              then one process per host (below)
any + --spmd  (see --help)    single controller: one process per host drives every
                              local device (torch_xla's SPMD mode, turned on here
                              before the script runs); the script sees world 1 and
                              ordinal 0, feeds each global batch, and xla_fsdp splits
                              it, and every parameter, over the devices
TPU + --per_chip              one process per chip whatever the script declares
============  ==============  ================================================

The runtime variable (docs/environment.md) set to ``single_controller`` /
``multi_process`` chooses as ``--spmd`` / ``--per_chip`` do; so does torch_xla's
SPMD variable for the single controller. The launcher prints its choice and the
world the script will see in one line. On a TPU the launcher also sets
libtpu's async-collective flags in ``LIBTPU_INIT_ARGS`` unless you set it
(``xla_fsdp.tpu.libtpu_flags``).

The engine is the script's choice (``xla_fsdp_v2`` in the fsdp config selects
the GSPMD engine; the collective engine runs in either runtime). Why CPU never spawns several replicas: explicit XLA
collectives between processes (device threads, on CPU) race their compiles and
hang (pytorch/xla issues 5005 and 9089), while one process driving N virtual
devices runs the same collectives inside one SPMD program. A script written
for one process per device (torch_xla's FSDP examples) would see world 1 there
and shard its data for one replica, so on CPU it runs at N > 1 only when asked.

TPU subsets: PJRT runs one process per chip and uses every chip the host's
topology exposes, so the valid counts are 1 and "every local device". To use
fewer chips, restrict the topology yourself with the documented variables
(``TPU_PROCESS_BOUNDS``, ``TPU_CHIPS_PER_PROCESS_BOUNDS``,
``TPU_VISIBLE_CHIPS``); the launcher counts the devices those leave visible.

Multi-host pods: run the *same* command on every worker
(``gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...``, as
``tpu_scripts/run.sh`` does). PJRT reads the pod topology from the TPU
metadata on each worker and joins the processes of all workers into one job;
the launcher needs no address or rank flags. ``--num_cores`` counts the
devices of one worker; ``--num_cores 1`` on a pod worker runs a separate
one-chip job there, which is only useful for debugging.

Failures: if a replica raises, the launcher prints that replica's traceback and
exits 1; in the spawn path the failing replica exits at once so the process
pool breaks and the remaining replicas are terminated instead of waiting
forever in a collective. Ctrl-C stops every replica and exits 130. SIGTERM (a spot
VM's preemption, a maintenance event) goes on to the job: run_clm saves a checkpoint at
the end of its step on every replica and exits 75, and so does the launcher; the same
command resumes (docs/checkpoints.md). Usage errors
(bad ``--num_cores``, missing script, missing ``_mp_fn``, an entry point that
cannot take what it is passed, a runtime this machine cannot run) exit 2 without
a traceback.

``PJRT_DEVICE`` is detected when unset: TPU when TPU device files
(``/dev/accel*``, ``/dev/vfio/<n>``) or TPU environment variables are present,
else CPU.
"""
from __future__ import annotations

import sys

# The launcher lives in xla_fsdp/launcher/ (one module per concern); these are its names as
# this script has always offered them (tests and tests/fixtures/spawn_pool_driver.py use them).
from xla_fsdp.launcher.command_line import (CPU_MAX_DEVICES, ENTRY_POINT, EXIT_FAILED, EXIT_INTERRUPTED,  # noqa: F401
                                            EXIT_USAGE, PROG, RUNTIME_ENV, RUNTIME_MARKER, SINGLE_CONTROLLER,
                                            UsageError, build_parser, log, split_argv)
from xla_fsdp.launcher.main import main
from xla_fsdp.launcher.plan import (DeviceCounts, LaunchPlan, async_collective_flags, detect_device,  # noqa: F401
                                    device_counts, make_plan, parse_num_cores, quiet_xla_logs, slice_chips,
                                    tpu_local_device_count)
from xla_fsdp.launcher.run_script import (ScriptEntry, defines_entry_point, describe_start, exit_code,  # noqa: F401
                                          run_as_main, run_in_process, run_self_starting, run_spawned)
from xla_fsdp.launcher.single_controller import (choose_spmd, cpu_replicas, declares_single_controller,  # noqa: F401
                                                 per_chip_asked, refuse_single_controller_only)

if __name__ == "__main__":
    sys.exit(main())
