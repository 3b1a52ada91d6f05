"""Checkpoints: sharded, resumable, reloadable on any layout, consolidated offline.

- `save_checkpoint` / `load_checkpoint`: every process writes the rows it holds of every parameter and optimizer state
  (atomically) and reads back the rows it needs, whatever layout saved them (`save.py`, `load.py`, format in
  `format.py`).
- `CheckpointManager` / `latest_checkpoint`: `checkpoint-<step>` folders, keep-last-K rotation, the newest complete one
  for resuming (`manager.py`).
- `consolidate` and `python -m xla_fsdp.checkpoint consolidate`: the full model, streamed, as a Hugging Face
  `save_pretrained` directory (`consolidate.py`).
- `save_pretrained`: the running job's model as a Hugging Face directory (`export.py`).
- `consolidate_sharded_model_checkpoints`: torch_xla's per-rank flow (`torch_xla_compat.py`).
- In-memory full and sharded state dicts (`state_dict.py`).
- `Preemption`: a SIGTERM turned into a checkpoint at the next step boundary (`preemption.py`)."""
from .consolidate import consolidate
from .export import save_pretrained
from .format import CheckpointError
from .load import load_checkpoint
from .manager import CheckpointManager, complete_checkpoints, latest_checkpoint
from .preemption import EXIT_PREEMPTED, Preemption
from .save import CheckpointWriteError, save_checkpoint
from .state_dict import full_state_dict, load_full_state_dict, load_sharded_state_dict, sharded_state_dict
from .torch_xla_compat import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts

__all__ = [
    "save_checkpoint", "load_checkpoint", "CheckpointManager", "latest_checkpoint", "complete_checkpoints",
    "consolidate", "save_pretrained", "consolidate_sharded_model_checkpoints", "consolidate_sharded_state_dicts",
    "CheckpointError", "CheckpointWriteError", "Preemption", "EXIT_PREEMPTED",
    "full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict",
]
