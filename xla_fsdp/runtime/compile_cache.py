"""The persistent compilation cache: compiled programs kept on disk, so a restarted job compiles nothing.

[Note: the persistent compilation cache] torch_xla 2.9 keys each compiled program by a hash of its HLO and the compile
options, writes the executable under `XLA_PERSISTENT_CACHE_PATH`, and on a later run with the same program loads it
instead of compiling (`torch_xla.runtime.initialize_cache`). The path is read once, when the first program is compiled,
so it is chosen before that: by `run_clm --compile_cache DIR` (default: `compile_cache/` under a local `--output_dir`),
or for any script under the launcher by the compile-cache variable (`environment.COMPILE_CACHE`) set to a folder. Each
process gets a folder of its own: one per host under the single controller (`host-<i>`, as on a shared mount hosts must
not write the same files), one per replica with one process per chip (`rank-<i>`). torch_xla counts what happened
(`PersistentCacheHit`, `PersistentCacheMiss`, `PersistentCacheDeserializeFailure`); `summary()` says it in one line.

On XLA:CPU a second run finds its key (a `PersistentCacheDeserializeFailure`, not a `Miss`) but compiles again:
torch_xla 2.9's CPU client does not deserialize executables. On a TPU the executable loads."""
from __future__ import annotations

import os
from typing import Dict, Optional

from xla_fsdp.runtime import environment

ENV = environment.COMPILE_CACHE
TORCH_XLA_ENV = environment.TORCH_XLA_CACHE
OFF = ("off", "none", "no", "false", "0")
COUNTERS = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")


class CompileCacheError(ValueError):
    """The cache folder cannot be used; the message says which and what to do."""


def host_index() -> int:
    """This host's index before the XLA runtime starts (a pod's TPU_WORKER_ID, a virtual host's index)."""
    return environment.host_index_before_start()


def too_late(path: str) -> bool:
    """Whether this process compiled a program already, with the cache elsewhere or off (torch_xla reads the setting at
    the first compile)."""
    import torch_xla

    return bool(torch_xla._XLAC._xla_computation_cache_is_initialized()) and \
        environment.get(TORCH_XLA_ENV) != os.path.abspath(path)


def enable(base: str, part: str) -> str:
    """Keep compiled programs under `base`/`part` (created); returns that folder. Raises CompileCacheError for a
    folder that cannot be written, or when a program was already compiled in this process (the cache can no longer be
    chosen)."""
    import torch_xla
    import torch_xla.runtime as xr

    path = os.path.join(os.path.abspath(os.path.expanduser(base)), part)
    current = environment.get(TORCH_XLA_ENV) or None
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if current == path:
            return path
        raise CompileCacheError(
            f"the compile cache {path} was asked for after this process compiled its first program, when torch_xla "
            f"reads the setting; set {ENV}={base} for the launcher (or choose it before any XLA tensor is computed)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".writable-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise CompileCacheError(f"the compile cache folder {path} cannot be written ({e.strerror or e}); "
                                f"give a writable folder (--compile_cache DIR or {ENV}=DIR), or 'off'") from None
    xr.initialize_cache(path, readonly=False)
    return path


def from_environment(part: str) -> Optional[str]:
    """`enable(<the compile-cache variable>, part)` when that variable names a folder, else None."""
    base = environment.get(ENV)
    return enable(base, part) if base and base.lower() not in OFF else None


def counts() -> Dict[str, int]:
    import torch_xla.debug.metrics as met

    return {name: int(met.counter_value(name) or 0) for name in COUNTERS}


def summary(path: str) -> str:
    """One line on what the cache did in this process."""
    c = counts()
    hit, miss, failed = (c[name] for name in COUNTERS)
    line = f"compile cache {path}: {hit} program(s) loaded, {miss} compiled and stored"
    if failed:
        line += (f", {failed} found but not loadable (compiled again: torch_xla 2.9's XLA:CPU client does not "
                 "load stored executables; a TPU does)")
    return line
