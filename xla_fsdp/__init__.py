"""xla_fsdp: fully sharded data parallel training for PyTorch/XLA.

Public entry points: `XlaFullyShardedDataParallel` (alias `FSDP`), torch_xla's FSDPv2 name
`SpmdFullyShardedDataParallel` (on the GSPMD engine), the auto-wrap policies in `xla_fsdp.wrap`, `checkpoint_module`,
deferred initialization (`deferred_init`, `materialize_module`, `is_deferred`), the Hugging Face `fsdp_config` loader
(`xla_fsdp.config.load_fsdp_config`), checkpoints (`xla_fsdp.checkpoint`; torch_xla's
`consolidate_sharded_model_checkpoints`)."""
from .tpu import libtpu_flags as _libtpu_flags

# On a TPU, before libtpu starts: its async-collective flags, unless the user set LIBTPU_INIT_ARGS
_libtpu_flags.set_defaults()

# [Note: a package root that loads on first use] `import xla_fsdp` sets libtpu's flags and the moved modules' finder,
# nothing else: public names and submodules (`xla_fsdp.wrap`) load their module when first read. So the tools that need
# no torch (`python -m xla_fsdp.aot`'s own process, the launcher) start in under 0.1 s, not the seconds torch and
# torch_xla take to import.
_PUBLIC = {
    "checkpoint_module": ".activation_checkpoint",
    "FSDP": ".api", "XlaFullyShardedDataParallel": ".api",
    "consolidate_sharded_model_checkpoints": ".checkpoint",
    "MixedPrecision": ".options", "ShardingStrategy": ".options",
    "SpmdFullyShardedDataParallel": ".fsdpv2",
    "always_wrap_policy": ".wrap", "lambda_auto_wrap_policy": ".wrap", "size_based_auto_wrap_policy": ".wrap",
    "transformer_auto_wrap_policy": ".wrap",
    "deferred_init": ".deferred.compat", "is_deferred": ".deferred.compat",
    "materialize_module": ".deferred.compat",
}


def __getattr__(name: str):
    import importlib

    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


class _MovedModules:
    """[Note: moved modules keep their import paths] Two module paths users write that no longer hold a module keep
    working (tests/test_public_api.py): `import xla_fsdp.state_dict` gives `xla_fsdp.checkpoint.state_dict` itself,
    loaded on first import, and torchdistx's `xla_fsdp.deferred_init`. `xla_fsdp.deferred_init` stays the *function*
    after `import xla_fsdp.deferred_init`: the import system would set the parent's attribute to the module, which
    `_Package` refuses. One of the import-time effects docs/DESIGN.md lists."""

    MOVED = {__name__ + ".state_dict": ".checkpoint.state_dict", __name__ + ".deferred_init": ".deferred.compat"}

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
    import types

    class _Package(types.ModuleType):
        def __setattr__(self, name, value):
            if name == "deferred_init" and isinstance(value, types.ModuleType):
                return  # the import of xla_fsdp.deferred_init: the attribute stays the function
            super().__setattr__(name, value)

    sys.modules[__name__].__class__ = _Package
    sys.meta_path.append(_MovedModules())


_keep_old_module_paths()


__all__ = list(_PUBLIC)
