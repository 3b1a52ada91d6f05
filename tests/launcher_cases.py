"""How the launcher tests run launch/xla_spawn.py: as users do, a subprocess on PJRT_DEVICE=CPU
with no runtime choice inherited from the environment."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "xla_spawn.py"
FIXTURES = ROOT / "tests" / "fixtures"
TIMEOUT_S = 60


def launcher_env(**overrides):
    env = dict(os.environ)
    for name in ("CPU_NUM_DEVICES", "XLA_FSDP_ENGINE", "XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "TPU_ACCELERATOR_TYPE",
                 "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_BOUNDS",
                 "TPU_SKIP_MDS_QUERY"):
        env.pop(name, None)
    env["PJRT_DEVICE"] = "CPU"
    env.update(overrides)
    return env


def launch(*args, env=None, timeout=TIMEOUT_S):
    return subprocess.run([sys.executable, str(LAUNCHER), *map(str, args)],
                          cwd=ROOT, env=env or launcher_env(), capture_output=True,
                          text=True, timeout=timeout)


def load_launcher_module():
    spec = importlib.util.spec_from_file_location("xla_spawn_under_test", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
