"""Check a training job for a Cloud TPU slice before renting it (ahead-of-time compile).

    python -m xla_fsdp.aot --tpu v4-8 -- launch/run_clm.py <the job's flags>

traces two steps of the job on this host at the slice's device count, in
the runtime it would use there (nothing executes: [Note: abstract tracing]),
compiles the second step with libtpu's own compiler for the slice's
topology, and reports whether it compiles, its HBM per chip against the
chip's, and the collectives of the TPU-optimized program.
"""
