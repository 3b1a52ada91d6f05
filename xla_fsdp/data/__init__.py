"""Data for the SPMD runtimes on a multi-host slice: each host reads only the rows of a global batch that the batch
sharding places on its own devices, and builds the global XLA tensor from them ([Note: per-host batches] in
`per_host.py`)."""
from .per_host import HostBatches, device_rows, host_rows, tile_rows

__all__ = ["HostBatches", "device_rows", "host_rows", "tile_rows"]
