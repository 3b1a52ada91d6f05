"""Deferred module construction without torchdistx (see ``materialize.py``), and tied embeddings that moving a model to
the device untied (``tied_embeddings.py``)."""

from .graph import DeferredInitError
from .materialize import deferred_init, is_deferred, materialize_module, materialize_tensor
from .meta_init import reset_meta_modules

__all__ = [
    "DeferredInitError",
    "deferred_init",
    "is_deferred",
    "materialize_module",
    "materialize_tensor",
    "reset_meta_modules",
]
