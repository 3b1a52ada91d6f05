"""torch_xla's FSDPv2 name, `SpmdFullyShardedDataParallel`, on our GSPMD engine (docs/migration.md, "torch_xla's
FSDPv2"): a script written for `torch_xla.experimental.spmd_fully_sharded_data_parallel` swaps that import for `from
xla_fsdp import SpmdFullyShardedDataParallel`.

- `door.py`: the class, its argument checks, and the inner calls an `auto_wrapper_callable` makes;
- `outputs.py`: `shard_output`, torch_xla's default and the hook that runs it after a unit's forward."""
from .door import SpmdFullyShardedDataParallel

__all__ = ["SpmdFullyShardedDataParallel"]
