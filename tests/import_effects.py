"""What importing a module of ours changes outside the package (run by tests/test_import_effects.py).

    python tests/import_effects.py MODULE modules    # the torch/torch_xla modules MODULE loads (JSON list)
    python tests/import_effects.py MODULE effects    # what `import MODULE` changed (JSON list of keys)

`effects` first imports every module `modules` listed (so their own import-time work is not
counted), takes a snapshot of what could be patched, imports MODULE, and compares: every
attribute of those modules and of the classes defined in them (replaced or added; a submodule
set on its package by an import is not a patch), os.environ, sys.meta_path and sys.path_hooks,
torch's global optimizer and module hooks, torch.distributed's rendezvous handlers, the warning
filters, the signal handlers and the excepthook. Each change is one key, named as in
docs/DESIGN.md's "Import-time effects" table.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import types
import warnings

PREFIXES = ("torch", "torch_xla", "transformers", "accelerate", "jax", "safetensors", "fsspec")


def _ours(name: str) -> bool:
    return name == "xla_fsdp" or name.startswith("xla_fsdp.")


def _watched(name: str) -> bool:
    return name.split(".")[0] in PREFIXES


def _attrs(obj) -> dict:
    out = {}
    for key, value in list(vars(obj).items()):
        if not isinstance(value, types.ModuleType):
            out[key] = id(value)
    return out


def snapshot() -> dict:
    state = {"env": dict(os.environ), "meta_path": [type(f).__qualname__ for f in sys.meta_path],
             "path_hooks": [id(h) for h in sys.path_hooks], "excepthook": id(sys.excepthook),
             "warning_filters": list(map(repr, warnings.filters)), "attrs": {}}
    state["signals"] = {int(s): id(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)}
    import torch.nn.modules.module as nn_module
    import torch.optim.optimizer as optim

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (the package re-exports a function)
    state["rendezvous"] = {k: id(v) for k, v in rdzv._rendezvous_handlers.items()}
    state["optimizer_hooks"] = (len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks))
    state["module_hooks"] = tuple(len(getattr(nn_module, n)) for n in dir(nn_module)
                                  if n.startswith("_global_") and n.endswith("hooks"))
    with warnings.catch_warnings():  # torch's deprecated module attributes warn when read
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is None or not _watched(name):
                continue
            state["attrs"][name] = _attrs(module)
            for key, value in list(vars(module).items()):
                if isinstance(value, type) and getattr(value, "__module__", None) == name:
                    state["attrs"][f"{name}.{key}"] = _attrs(value)
    return state


def _owner(path: str):
    name, _, rest = path.partition(":")
    obj = sys.modules[name]
    for part in filter(None, rest.split(".")):
        obj = getattr(obj, part)
    return obj


def effects(before: dict, after: dict) -> list:
    keys = set()
    for k in set(before["env"]) | set(after["env"]):
        if before["env"].get(k) != after["env"].get(k):
            keys.add(f"os.environ[{k}]")
    for finder in after["meta_path"][len(before["meta_path"]):]:
        keys.add(f"sys.meta_path:{finder}")
    for what in ("path_hooks", "excepthook", "warning_filters", "signals", "optimizer_hooks", "module_hooks"):
        if before[what] != after[what]:
            keys.add(what)
    for handler in set(before["rendezvous"]) | set(after["rendezvous"]):
        if before["rendezvous"].get(handler) != after["rendezvous"].get(handler):
            keys.add(f"rendezvous[{handler}]")
    for owner, attrs in before["attrs"].items():
        now = after["attrs"].get(owner, {})
        for key, value in now.items():
            if attrs.get(key, value) != value or (key not in attrs and not key.startswith("__")):
                keys.add(f"{owner}.{key}")
    return sorted(keys)


def main() -> None:
    target, what = sys.argv[1], sys.argv[2]
    if what == "modules":
        importlib.import_module(target)
        print(json.dumps(sorted(n for n in sys.modules if _watched(n))))
        return
    for name in json.loads(sys.stdin.read()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that fails alone is imported by its parent
            pass
    before = snapshot()
    __import__(target)  # the import statement's path: `python -X importtime` times it (import_module is not timed)
    after = snapshot()
    print(json.dumps(effects(before, after)))


if __name__ == "__main__":
    main()
