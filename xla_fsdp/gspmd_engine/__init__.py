"""The GSPMD engine (`engine="spmd"`, Hugging Face's `xla_fsdp_v2`).

Parameters are annotated as sharded on dim 0 over the mesh axis "fsdp" and the XLA SPMD partitioner inserts the
collectives:
- `engine.py`: `apply_spmd_fsdp`, the steps in order;
- `units.py`: which modules are units, and how their tensors reach the mesh;
- `params.py`: the compute views (compute dtype, optional forced gather);
- `activations.py`: batch-dim activation annotations and unit checkpointing;
- `norms.py`: layer norms the partitioner can split along the batch.

The mesh helpers live in `xla_fsdp.runtime.mesh`. Nothing here imports the front door.
"""
