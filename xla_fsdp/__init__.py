"""xla_fsdp: fully sharded data parallel training for PyTorch/XLA.

Public entry points: `XlaFullyShardedDataParallel` (alias `FSDP`), torch_xla's FSDPv2 name
`SpmdFullyShardedDataParallel` (on the GSPMD engine), the auto-wrap
policies in `xla_fsdp.wrap`, `checkpoint_module`, deferred initialization
(`deferred_init`, `materialize_module`, `is_deferred`), the Hugging Face
`fsdp_config` loader (`xla_fsdp.config.load_fsdp_config`), checkpoints
(`xla_fsdp.checkpoint`; torch_xla's `consolidate_sharded_model_checkpoints`).
"""
from .tpu import libtpu_flags as _libtpu_flags

# On a TPU, before libtpu starts: its async-collective flags, unless the user set LIBTPU_INIT_ARGS
_libtpu_flags.set_defaults()

from .activation_checkpoint import checkpoint_module  # noqa: E402
from .api import FSDP, XlaFullyShardedDataParallel
from .checkpoint import consolidate_sharded_model_checkpoints
from .options import MixedPrecision, ShardingStrategy
from .spmd_fsdp import SpmdFullyShardedDataParallel
from .wrap import (always_wrap_policy, lambda_auto_wrap_policy, size_based_auto_wrap_policy,
                   transformer_auto_wrap_policy)

from .deferred.compat import deferred_init, is_deferred, materialize_module  # noqa: E402


class _MovedModules:
    """[Note: moved modules keep their import paths]
    Modules users import by name stay importable where they were before the package's root was
    tidied into folders (tests/test_public_api.py imports each): `import xla_fsdp.hosts` gives
    `xla_fsdp.runtime.hosts` itself, not a copy, loaded on first import (importing xla_fsdp does
    not start torch_xla's mesh code). The two already loaded here are entered in sys.modules at
    once (`xla_fsdp.deferred_init` must stay the *function* above, torchdistx's call shape, and an
    entry in sys.modules keeps the import system from setting the attribute to the module). This
    finder is one of the import-time effects docs/DESIGN.md lists."""

    MOVED = {__name__ + ".hosts": ".runtime.hosts", __name__ + ".mesh": ".runtime.mesh",
             __name__ + ".runtime_choice": ".runtime.choice"}

    def find_spec(self, fullname, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(fullname, self) if fullname in self.MOVED else None

    def create_module(self, spec):
        import importlib

        return importlib.import_module(self.MOVED[spec.name], __name__)

    def exec_module(self, module):
        pass  # the moved module ran when it was imported


def _keep_old_module_paths() -> None:
    import sys

    from .checkpoint import state_dict as _state_dict
    from .deferred import compat as _compat

    sys.modules[__name__ + ".state_dict"] = _state_dict
    globals()["state_dict"] = _state_dict  # as a submodule's import would have set it
    sys.modules[__name__ + ".deferred_init"] = _compat
    sys.meta_path.append(_MovedModules())


_keep_old_module_paths()


__all__ = [
    "XlaFullyShardedDataParallel", "FSDP", "SpmdFullyShardedDataParallel", "checkpoint_module", "MixedPrecision", "ShardingStrategy",
    "always_wrap_policy", "lambda_auto_wrap_policy", "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy", "deferred_init", "materialize_module", "is_deferred",
    "consolidate_sharded_model_checkpoints",
]
