"""The GSPMD engine (`engine="spmd"`, Hugging Face's `xla_fsdp_v2`): parameters are annotated as sharded on dim 0 over
the mesh axis "fsdp" and the XLA SPMD partitioner inserts the collectives. `engine.py`'s `apply_spmd_fsdp` runs the
steps in order (docs/DESIGN.md lists the other files); the mesh helpers live in `xla_fsdp.runtime.mesh`. Nothing here
imports the front door."""
