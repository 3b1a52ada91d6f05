"""The training programs we ship, as run_clm commands, for the TPU compile matrix.

Each case is a run_clm command (flags and an fsdp_config) and a runtime; the
check (`python -m xla_fsdp.aot`) traces it at the slice's device count and
compiles it with libtpu. Shared by tests/test_tpu_compile_matrix.py (and the
other tests that run the check) and bench/'s TPU tables.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import REPO as ROOT

RUN_CLM = os.path.join(ROOT, "launch", "run_clm.py")
TINY = os.path.join(ROOT, "configs", "models", "gpt2-tiny.json")
SINGLE, MULTI = "single_controller", "multi_process"


@dataclass(frozen=True)
class AotCase:
    name: str
    runtime: str
    settings: Dict = field(default_factory=dict)     # xla_fsdp_settings
    top: Dict = field(default_factory=dict)          # other fsdp_config keys
    flags: tuple = ()                                # extra run_clm flags
    fsdp: str = "full_shard"

    def fsdp_config(self, devices: int) -> dict:
        settings = {"compute_dtype": "bfloat16", **self.settings}
        if self.fsdp == "hybrid_shard":  # two replicas, each sharded over half the slice
            settings["sharding_groups"] = [list(range(devices // 2)), list(range(devices // 2, devices))]
        return {"fsdp_transformer_layer_cls_to_wrap": ["GPT2Block"], "xla": True,
                "xla_fsdp_settings": settings, **self.top}


def _cases(runtime: str) -> List[AotCase]:
    r = "sc" if runtime == SINGLE else "mp"
    return [
        AotCase(f"{r}-full_shard", runtime),
        AotCase(f"{r}-shard_grad_op", runtime, fsdp="shard_grad_op"),
        AotCase(f"{r}-no_shard", runtime, fsdp="no_shard"),
        AotCase(f"{r}-hybrid", runtime, fsdp="hybrid_shard"),
        AotCase(f"{r}-flat", runtime, {"flatten_parameters": True}),
        AotCase(f"{r}-all_reduce_gather", runtime, {"all_gather_impl": "all_reduce"}),
        AotCase(f"{r}-no_prefetch", runtime, top={"forward_prefetch": False, "backward_prefetch": "NO_PREFETCH"}),
        AotCase(f"{r}-grad_ckpt", runtime, top={"xla_fsdp_grad_ckpt": True}),
        AotCase(f"{r}-no_clip", runtime, flags=("--max_grad_norm", "0")),
        AotCase(f"{r}-accumulate", runtime, flags=("--gradient_accumulation_steps", "2")),
    ]


MATRIX: List[AotCase] = _cases(MULTI) + _cases(SINGLE) + [
    AotCase("gspmd", SINGLE, top={"xla_fsdp_v2": True}),
]
BY_NAME = {c.name: c for c in MATRIX}


def command(case: AotCase, devices: int, config_path: str, out_dir: str, model: str = TINY, batch: int = 2,
            block: int = 64) -> List[str]:
    """The run_clm command of `case` at `devices` (its fsdp_config written to `config_path`)."""
    with open(config_path, "w") as f:
        json.dump(case.fsdp_config(devices), f)
    return [RUN_CLM, "--config_name", model, "--fsdp", case.fsdp, "--fsdp_config", config_path,
            "--output_dir", out_dir, "--do_train", "--per_device_train_batch_size", str(batch),
            "--block_size", str(block), *case.flags]


def check(tpu: str, cmd: List[str], runtime: str = "auto", extra: Optional[List[str]] = None,
          timeout: float = 1200, env_extra: Optional[Dict[str, str]] = None) -> dict:
    """Run `python -m xla_fsdp.aot --json` on `cmd`; returns {"rc", "report" (None when the check
    printed no JSON), "output" (the tail of stdout and stderr)}."""
    argv = [sys.executable, "-m", "xla_fsdp.aot", "--tpu", tpu, "--runtime", runtime, "--json",
            *(extra or []), "--", *cmd]
    env = dict(os.environ)
    for name in ("XLA_FSDP_ENGINE", "XLA_FSDP_RUNTIME", "XLA_USE_SPMD", "CPU_NUM_DEVICES", "LIBTPU_INIT_ARGS"):
        env.pop(name, None)
    env.update(env_extra or {})
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    report = None
    if proc.stdout.strip().startswith("{"):
        report = json.loads(proc.stdout)
    return {"rc": proc.returncode, "report": report, "output": proc.stdout[-3000:] + proc.stderr[-5000:]}


class Compiles:
    """Traced modules compiled for one slice, each once per flag set: a check's own compile (its
    report and --dump) is kept as the compile with the flags it was given, so a test that traces
    through the check and compiles the module again with the same flags compiles nothing."""

    def __init__(self, tpu: str):
        self.tpu = tpu
        self._done: Dict[tuple, dict] = {}

    @staticmethod
    def _key(text: str, flags: Dict[str, str]) -> tuple:
        return hash(text), len(text), tuple(sorted(flags.items()))

    def trace(self, cmd: List[str], dump: str, flags: Dict[str, str], runtime: str = "auto") -> str:
        """`cmd` traced and compiled by the check with `flags`; the traced module's text."""
        from xla_fsdp.tpu import libtpu_flags as lf

        got = check(self.tpu, cmd, runtime=runtime, extra=["--dump", dump, "--libtpu-flags", lf.init_args(flags)])
        assert got["report"] and got["report"]["compiles"], got["output"]
        with open(os.path.join(dump, "traced_step.hlo.txt")) as f:
            text = f.read()
        with open(os.path.join(dump, "tpu_optimized.hlo.txt")) as f:
            self._done[self._key(text, flags)] = dict(got["report"], optimized_hlo=f.read())
        return text

    def compile(self, text: str, flags: Dict[str, str]) -> dict:
        """The check's report of `text` compiled with `flags` (with its "optimized_hlo")."""
        key = self._key(text, flags)
        if key not in self._done:
            from xla_fsdp.aot import report
            from xla_fsdp.aot.cli import _load_compiler
            from xla_fsdp.tpu import libtpu_flags as lf
            from xla_fsdp.tpu import topology

            r = report.check_program(text, topology.parse_accelerator_type(self.tpu), _load_compiler(),
                                     lf.init_args(flags), say=lambda *a: None)
            assert r["compiles"], r["error"][:2000]
            self._done[key] = r
        return self._done[key]
