"""PyTorch FSDP2's API on XLA: `fully_shard`, `FSDPModule` and the policies.

The names and path mirror `torch.distributed.fsdp`, so porting an FSDP2 script changes its import lines, the device and
the process group's init line (README, "FSDP2 scripts"). It runs on the single controller (one process per host driving
every chip) with the collective engine ([Note: fully_shard on XLA])."""
from .fully_shard import fully_shard
from .module import FSDPModule, UnshardHandle
from ..collective_engine.sharded_param import ShardedParameter
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .process_group import install as _install_rendezvous
from .torch_guard import install as _install_torch_guard

_install_torch_guard()
_install_rendezvous()

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "ShardedParameter", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy"]
