"""torchdistx-compatible deferred initialization: ``deferred_init``, ``materialize_module``, ``materialize_tensor``,
``is_deferred``.

Users of the published recipe wrote ``deferred_init.deferred_init(fn, cfg)`` and ``materialize_module(m, check_fn=...)``
against torchdistx.  torchdistx is not built for torch >= 2.0, so when it cannot be imported we use our own recorder
(``xla_fsdp/deferred/``); when it can, we delegate so both behave the same."""

try:  # pragma: no cover - torchdistx is not installable on current torch
    from torchdistx.deferred_init import (  # type: ignore[import-not-found]
        deferred_init, is_deferred, materialize_module, materialize_tensor)

    BACKEND = "torchdistx"
except ImportError:
    from .materialize import deferred_init, is_deferred, materialize_module, materialize_tensor

    BACKEND = "xla_fsdp"

from .graph import DeferredInitError

# `xla_fsdp/__init__.py` exports the *function* `deferred_init`, which shadows this module as the attribute
# `xla_fsdp.deferred_init`.  The recipe's code is `deferred_init.deferred_init(fn, cfg)` and
# `deferred_init.materialize_module(m)` on the torchdistx *module*; giving the function the module's public names keeps
# that code working after `from xla_fsdp import deferred_init`.
for _name in ("deferred_init", "materialize_module", "materialize_tensor", "is_deferred"):
    setattr(deferred_init, _name, globals()[_name])
del _name

__all__ = ["BACKEND", "DeferredInitError", "deferred_init", "is_deferred", "materialize_module", "materialize_tensor",]
