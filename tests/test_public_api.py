"""Every public name README.md and docs/ show imports from where they say, as what they say."""
import importlib
import inspect
import os
import subprocess
import sys

import pytest
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (module, name, kind): kind is "class", "function" or "value"
PUBLIC = [
    ("xla_fsdp", "XlaFullyShardedDataParallel", "class"),
    ("xla_fsdp", "FSDP", "class"),
    ("xla_fsdp", "SpmdFullyShardedDataParallel", "class"),
    ("xla_fsdp", "checkpoint_module", "function"),
    ("xla_fsdp", "MixedPrecision", "class"),
    ("xla_fsdp", "ShardingStrategy", "class"),
    ("xla_fsdp", "deferred_init", "function"),
    ("xla_fsdp", "materialize_module", "function"),
    ("xla_fsdp", "is_deferred", "function"),
    ("xla_fsdp", "always_wrap_policy", "function"),
    ("xla_fsdp", "lambda_auto_wrap_policy", "function"),
    ("xla_fsdp", "size_based_auto_wrap_policy", "function"),
    ("xla_fsdp", "transformer_auto_wrap_policy", "function"),
    ("xla_fsdp.wrap", "transformer_policy", "function"),
    ("xla_fsdp.wrap", "transformer_auto_wrap_policy", "function"),
    ("xla_fsdp.wrap", "size_based_auto_wrap_policy", "function"),
    ("xla_fsdp.wrap", "lambda_auto_wrap_policy", "function"),
    ("xla_fsdp.wrap", "always_wrap_policy", "function"),
    ("xla_fsdp.config", "load_fsdp_config", "function"),
    ("xla_fsdp.config", "checkpointed_wrapper", "function"),
    ("xla_fsdp.config", "FSDPConfig", "class"),
    ("xla_fsdp.config", "FSDPConfigError", "class"),
    ("xla_fsdp.config", "XlaFSDPSettings", "class"),
    ("xla_fsdp.config", "ENGINE_KEYWORDS", "value"),
    ("xla_fsdp.config", "SPMD_ENGINE_KEYWORDS", "value"),
    ("xla_fsdp.deferred_init", "deferred_init", "function"),
    ("xla_fsdp.deferred_init", "materialize_module", "function"),
    ("xla_fsdp.deferred_init", "materialize_tensor", "function"),
    ("xla_fsdp.deferred_init", "is_deferred", "function"),
    ("xla_fsdp.deferred_init", "DeferredInitError", "class"),
    ("xla_fsdp.state_dict", "full_state_dict", "function"),
    ("xla_fsdp.state_dict", "load_full_state_dict", "function"),
    ("xla_fsdp.state_dict", "sharded_state_dict", "function"),
    ("xla_fsdp.state_dict", "load_sharded_state_dict", "function"),
    ("xla_fsdp.checkpoint", "full_state_dict", "function"),
    ("xla_fsdp.checkpoint", "load_full_state_dict", "function"),
    ("xla_fsdp.checkpoint", "sharded_state_dict", "function"),
    ("xla_fsdp.checkpoint", "load_sharded_state_dict", "function"),
    ("xla_fsdp.train.job", "run", "function"),  # launch/run_clm.py
]


@pytest.mark.parametrize("module,name,kind", PUBLIC, ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_public_name(module, name, kind):
    obj = getattr(importlib.import_module(module), name)
    if kind == "class":
        assert inspect.isclass(obj), f"{module}.{name} is {type(obj).__name__}, expected a class"
    elif kind == "function":
        assert callable(obj) and not inspect.isclass(obj), f"{module}.{name} is {type(obj).__name__}, expected a function"


def test_front_door_class():
    import xla_fsdp

    assert xla_fsdp.FSDP is xla_fsdp.XlaFullyShardedDataParallel
    assert issubclass(xla_fsdp.FSDP, nn.Module)
    for method in ("clip_grad_norm_", "enable_activation_checkpointing"):
        assert callable(getattr(xla_fsdp.FSDP, method))
    assert isinstance(xla_fsdp.FSDP.sharding_layout, property)


def test_package_all_resolves():
    import xla_fsdp
    import xla_fsdp.config

    for package in (xla_fsdp, xla_fsdp.config, importlib.import_module("xla_fsdp.checkpoint")):
        missing = [n for n in package.__all__ if not hasattr(package, n)]
        assert not missing, f"{package.__name__}.__all__ names missing attributes: {missing}"


def test_state_dict_is_the_checkpoint_package():
    import xla_fsdp.checkpoint
    import xla_fsdp.state_dict

    for name in ("full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict"):
        assert getattr(xla_fsdp.state_dict, name) is getattr(xla_fsdp.checkpoint, name)


@pytest.mark.parametrize("old, new", [
    ("xla_fsdp.state_dict", "xla_fsdp.checkpoint.state_dict"),
    ("xla_fsdp.deferred_init", "xla_fsdp.deferred.compat"),
])
def test_moved_modules_keep_their_import_paths(old, new):
    """[Note: moved modules keep their import paths] in xla_fsdp/__init__.py: the old name is the
    module itself, in a fresh interpreter (nothing imported it first), and `from old import x` works."""
    code = "\n".join([
        "import importlib, sys",
        f"old = importlib.import_module({old!r}); new = importlib.import_module({new!r})",
        "assert old is new, (old, new)",
        "names = [n for n in dir(new) if not n.startswith('_') and callable(getattr(new, n))][:3]",
        f"ns = {{}}; exec('from {old} import ' + ', '.join(names), ns)",
        "assert all(ns[n] is getattr(new, n) for n in names) and names",
        "import xla_fsdp; assert callable(xla_fsdp.deferred_init) and not isinstance(xla_fsdp.deferred_init, type(sys))",
        "print('ok')",
    ])
    _prints_ok_in_a_fresh_interpreter(code)


def _prints_ok_in_a_fresh_interpreter(code: str, flags=()) -> None:
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_package_root_loads_torch_only_when_a_public_name_is_read():
    """[Note: a package root that loads on first use]: `import xla_fsdp` leaves torch unloaded
    (the check's and the launcher's own processes start without it), reading `FSDP` loads it, and
    `import xla_fsdp.deferred_init` keeps the attribute the function."""
    code = "\n".join([
        "import sys, types",
        "import xla_fsdp",
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]",
        "import xla_fsdp.launcher.main, xla_fsdp.aot.cli, xla_fsdp.runtime.allocator",
        "assert 'torch' not in sys.modules",
        "import xla_fsdp.deferred_init",
        "assert isinstance(sys.modules['xla_fsdp.deferred_init'], types.ModuleType)",
        "assert callable(xla_fsdp.deferred_init) and not isinstance(xla_fsdp.deferred_init, types.ModuleType)",
        "from xla_fsdp import FSDP",
        "assert 'torch' in sys.modules and FSDP is xla_fsdp.XlaFullyShardedDataParallel",
        "assert 'FSDP' in dir(xla_fsdp) and not hasattr(xla_fsdp, 'no_such_name')",
        "print('ok')",
    ])
    # -X: a real interpreter, not the suite's warm one that holds torch already ([Note: warm interpreters])
    _prints_ok_in_a_fresh_interpreter(code, flags=("-X", "importtime"))


def test_deferred_init_function_carries_the_module_names():
    # the recipe's `deferred_init.deferred_init(fn, cfg)` after `from xla_fsdp import deferred_init`
    from xla_fsdp import deferred_init as recipe_module

    for name in ("deferred_init", "materialize_module", "materialize_tensor", "is_deferred"):
        assert callable(getattr(recipe_module, name))


def test_config_engine_keywords_are_front_door_keywords():
    # config sits above the front door, so the front door cannot import ENGINE_KEYWORDS to stay in step
    from xla_fsdp.api import DEFAULTS
    from xla_fsdp.config import ENGINE_KEYWORDS, SPMD_ENGINE_KEYWORDS

    assert set(ENGINE_KEYWORDS) <= set(DEFAULTS)
    assert set(SPMD_ENGINE_KEYWORDS) <= set(ENGINE_KEYWORDS)


def test_readme_snippet_in_a_fresh_interpreter():
    """The README's own lines, in a process where nothing else imported a submodule first."""
    code = "\n".join([
        "import xla_fsdp",
        "from xla_fsdp import FSDP",
        "assert callable(xla_fsdp.wrap.transformer_policy(['GPT2Block']))",
        "assert callable(xla_fsdp.wrap.size_based_auto_wrap_policy)",
        "from xla_fsdp.config import load_fsdp_config",
        "from xla_fsdp.state_dict import full_state_dict, load_full_state_dict",
        "from xla_fsdp.state_dict import sharded_state_dict, load_sharded_state_dict",
        "from xla_fsdp.deferred_init import deferred_init, materialize_module, is_deferred",
        "print('ok')",
    ])
    _prints_ok_in_a_fresh_interpreter(code)
