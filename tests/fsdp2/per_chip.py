"""fully_shard in one process per chip (xmp.spawn): refused by name in every replica."""
import os
import sys

import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch_xla  # noqa: E402
import torch_xla.distributed.xla_multiprocessing as xmp  # noqa: E402


def _mp_fn(index):
    from xla_fsdp.fsdp import fully_shard

    torch_xla.device()
    try:
        fully_shard(nn.Linear(4, 4))
    except RuntimeError as e:
        print(f"replica {index} refused: {e}", flush=True)


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=())
