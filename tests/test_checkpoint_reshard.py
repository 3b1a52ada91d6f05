"""Save at one layout, load at another, go on training: the same run as never stopping.

Engines and runtimes mix too: checkpoints of gloo world 4 load into the
single-controller runtime (8 devices) and the GSPMD engine (8 devices); the
single-controller runtime's (4 devices) and the GSPMD engine's (4 devices)
load into gloo world 2 and XLA world 1 (the default run covers three of these
six pairs, one per engine and runtime; `pytest -m slow` all six).

A gloo world of 4 trains K=3 AdamW steps under FULL_SHARD, SHARD_GRAD_OP and
HYBRID_SHARD ([[0, 1], [2, 3]]) and saves model and optimizer state. Fresh,
differently seeded models on gloo worlds 2 and 8 (same strategy; HYBRID as two
halves) and on XLA world 1 load each checkpoint and train 3 more steps. Their
losses and final parameters must equal the unsharded reference trained 6
steps without stopping (fp32: losses 1e-5 relative, parameters 1e-5
tensor-relative). Gloo world 8 (eight processes) runs with `pytest -m slow`.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint_cases as cc
from parity_cases import assert_rel_close, run_distributed_fn

LAYOUTS = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]
JOBS = [("mlp_nested", "adamw", layout) for layout in LAYOUTS] + [("gpt2", "adamw", "FULL_SHARD")]


def _name(kind, optim, layout):
    return f"{kind}-{optim}-{layout}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reshard"))
    jobs = [{"kind": k, "optim": o, "layout": lay, "path": os.path.join(tmp, _name(k, o, lay))}
            for k, o, lay in JOBS]
    run_distributed_fn(cc.save_worker, 4, tmp, jobs)
    return tmp, jobs


class _Resumed(dict):
    """Each world's resumed runs, started when a test first asks for that world (gloo world 8,
    eight processes on this machine's cores, runs only under `-m slow`)."""

    def __init__(self, tmp, jobs):
        super().__init__()
        self.tmp, self.jobs = tmp, jobs

    def __missing__(self, world):
        if world == 1:
            self[world] = _resume_on_xla_world1(self.jobs)
        else:
            run_distributed_fn(cc.resume_worker, world, self.tmp, self.jobs)
            self[world] = torch.load(os.path.join(self.tmp, f"resumed-w{world}.pt"), weights_only=False)
        return self[world]


@pytest.fixture(scope="module")
def resumed(saved):
    tmp, jobs = saved
    return _Resumed(tmp, [dict(j, name=_name(j["kind"], j["optim"], j["layout"])) for j in jobs])


def _resume_on_xla_world1(jobs):
    import torch_xla

    from xla_fsdp.checkpoint import load_checkpoint

    out = {}
    for job in jobs:
        model, opt = cc.wrapped(job["kind"], job["optim"], cc.Layout(job["layout"]).kwargs(1), seed=7)
        got = load_checkpoint(job["path"], model, opt)
        losses = cc.train(model, opt, job["kind"], range(cc.K, cc.K + cc.MORE), device=torch_xla.device(),
                          sync=torch_xla.sync)
        out[job["name"]] = {"step": got["step"], "losses": losses, "params": cc.full_params(model)}
    return out


@pytest.fixture(scope="module")
def references():
    return {(k, o): cc.reference(k, o, cc.K + cc.MORE) for k, o, _ in JOBS}


@pytest.mark.parametrize("world", [1, 2, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind,optim,layout", JOBS, ids=lambda x: str(x))
def test_resumes_on_another_layout(resumed, references, world, kind, optim, layout):
    got = resumed[world][_name(kind, optim, layout)]
    ref = references[(kind, optim)]
    assert got["step"] == cc.K
    tol = dict(rtol=2e-5, atol=2e-6) if world == 1 else dict(rtol=1e-5, atol=1e-6)  # XLA:CPU sums differently
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][cc.K:]), **tol)
    for name, want in ref["params"].items():
        assert_rel_close(got["params"][name], want, 1e-5, f"{layout} -> world {world}: {name}")


def test_the_checkpoint_holds_each_row_once(saved):
    """Padding is never written and HYBRID's second group writes no copy: the rows of every
    parameter in the files add up to its size."""
    import json

    tmp, jobs = saved
    for job in jobs:
        path = job["path"]
        meta = json.load(open(os.path.join(path, "metadata.json")))
        rows = {}
        for rank in range(meta["world_size"]):
            index = json.load(open(os.path.join(path, f"index-rank{rank:05d}.json")))
            for key, info in index["tensors"].items():
                if key.startswith("param/"):
                    rows[key[6:]] = rows.get(key[6:], 0) + info["rows"][1] - info["rows"][0]
        for name, p in meta["params"].items():
            assert rows[name] == (p["shape"][0] if p["shape"] else 1), (job["layout"], name)


def _spmd(mode, engine, devices, tmp, jobs):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    env.pop("XLA_USE_SPMD", None)
    proc = subprocess.run([sys.executable, cc.__file__, mode, engine, tmp, json.dumps(jobs)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]


class _AcrossRuntimes:
    """(saved by, loaded by) -> results, each computed when first asked for (the default run
    asks for three pairs, `pytest -m slow` for all six)."""

    def __init__(self, saved, tmp_path_factory):
        self.tmp, gloo_jobs = saved
        self.gloo_jobs = [dict(j, name=_name(j["kind"], j["optim"], j["layout"])) for j in gloo_jobs]
        self.factory = tmp_path_factory
        self.saved_by = {}  # engine -> (dir, jobs) saved at 4 devices
        self.cache = {}

    def _saved_at_4(self, engine):
        if engine not in self.saved_by:
            sub = str(self.factory.mktemp(f"from-{engine}"))
            jobs = [{"kind": k, "optim": o, "layout": "FULL_SHARD", "name": _name(k, o, "FULL_SHARD"),
                     "path": os.path.join(sub, _name(k, o, "FULL_SHARD"))} for k, o in (("mlp", "adamw"),)]
            if engine == "collectives":
                jobs.append({"kind": "gpt2", "optim": "adamw", "layout": "HYBRID_SHARD",
                             "name": _name("gpt2", "adamw", "HYBRID_SHARD"),
                             "path": os.path.join(sub, _name("gpt2", "adamw", "HYBRID_SHARD"))})
            _spmd("save", engine, 4, sub, jobs)
            self.saved_by[engine] = (sub, jobs)
        return self.saved_by[engine]

    def __call__(self, source, target):
        if (source, target) not in self.cache:
            self.cache[source, target] = self._run(source, target)
        return self.cache[source, target]

    def _run(self, source, target):
        if source == "gloo4":  # gloo world 4 -> single controller or GSPMD engine, 8 devices
            engine = {"single8": "collectives", "gspmd8": "gspmd"}[target]
            jobs = self.gloo_jobs if engine == "collectives" else [j for j in self.gloo_jobs
                                                                   if j["layout"] == "FULL_SHARD"]
            _spmd("resume", engine, 8, self.tmp, jobs)
            return torch.load(os.path.join(self.tmp, f"resumed-{engine}.pt"), weights_only=False)
        # single controller or GSPMD engine, 4 devices -> gloo world 2 or XLA world 1
        sub, jobs = self._saved_at_4(source[:-1])
        if target == "gloo2":
            run_distributed_fn(cc.resume_worker, 2, sub, jobs)
            return torch.load(os.path.join(sub, "resumed-w2.pt"), weights_only=False)
        return _resume_on_xla_world1(jobs)


@pytest.fixture(scope="module")
def across_runtimes(saved, tmp_path_factory):
    return _AcrossRuntimes(saved, tmp_path_factory)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("source,target", [pytest.param("gloo4", "single8", marks=_SLOW),
                                           pytest.param("gloo4", "gspmd8", marks=_SLOW),
                                           ("collectives4", "gloo2"), pytest.param("collectives4", "xla1", marks=_SLOW),
                                           pytest.param("gspmd4", "gloo2", marks=_SLOW), ("gspmd4", "xla1")])
def test_resumes_across_engines_and_runtimes(across_runtimes, source, target):
    results = across_runtimes(source, target)
    assert results
    for name, got in results.items():
        kind, optim = name.split("-")[:2]
        ref = cc.reference(kind, optim, cc.K + cc.MORE)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][cc.K:]),
                                   rtol=2e-5, atol=2e-6)
        for pname, want in ref["params"].items():
            assert_rel_close(got["params"][pname], want, 1e-5, f"{source} -> {target}: {name} {pname}")
