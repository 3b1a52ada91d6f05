"""Per-host data under the SPMD runtimes ([Note: per-host batches] in xla_fsdp/data/per_host.py):
which rows of a global batch each host reads, and the global batch built from those rows alone.

The row arithmetic is checked directly for 1, 2 and 4 hosts over 8 devices; torch_xla's own layout
of a batch-sharded tensor, and two virtual hosts ([Note: virtual hosts] in xla_fsdp/runtime/hosts.py)
running run_clm's loop over their own rows, are checked in subprocesses (tests/per_host_data_cases.py):
the virtual hosts must build the single host's global batches, device by device, step by step,
and after a resume.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import per_host_data_cases as cases
import virtual_hosts as vh
from xla_fsdp.data import device_rows, host_rows, tile_rows
from xla_fsdp.train import data

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "per_host_data_cases.py")
GRIDS = {  # logical device grids of 8-device meshes, as mesh.get_logical_mesh() gives them
    "1d": np.arange(8),
    "2d_replica": np.arange(8).reshape(2, 4),                       # ("replica", "fsdp")
    "sharding_groups": np.array([[0, 2, 4, 6], [1, 3, 5, 7]]),       # the collective engine's groups mesh
}


def blocks_of(hosts: int, host: int, devices: int = 8):
    per = devices // hosts  # a pod host's (or virtual host's) devices: a block of ordinals
    return range(host * per, (host + 1) * per)


# ------------------------------------------------------------------ the rows each host reads
def test_tiles_are_xlas_ceil_sized_tiles_padding_last():
    assert tile_rows(16, 8) == [(2 * t, 2 * t + 2) for t in range(8)]
    assert tile_rows(12, 8) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12), (12, 12), (12, 12)]
    assert tile_rows(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    with pytest.raises(ValueError, match="global batch"):
        tile_rows(0, 4)


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("hosts", [1, 2, 4])
@pytest.mark.parametrize("batch", [16, 8, 12])
def test_hosts_read_every_row_of_a_global_batch_exactly_once(grid, hosts, batch):
    logical = GRIDS[grid]
    held = device_rows(batch, logical)
    parts = [host_rows(batch, logical, blocks_of(hosts, h)) for h in range(hosts)]
    assert sorted(r for part in parts for r in part) == list(range(batch))
    for h, part in enumerate(parts):
        assert part == sorted(part)
        want = sorted(r for d in blocks_of(hosts, h) for r in range(*held[d]))
        assert part == want
    if grid != "sharding_groups" and batch % 8 == 0:  # devices in order: host h reads one contiguous run
        per = batch // hosts
        assert parts == [list(range(h * per, (h + 1) * per)) for h in range(hosts)]


def test_rows_follow_the_mesh_device_order_not_the_ordinals():
    # groups [[0,2,4,6],[1,3,5,7]]: tiles go to devices 0,2,4,6,1,3,5,7, so host 0 (devices 0-3)
    # holds tiles 0, 1, 4, 5
    logical = GRIDS["sharding_groups"]
    assert device_rows(16, logical)[1] == (8, 10)
    assert host_rows(16, logical, range(4)) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert host_rows(16, logical, range(4, 8)) == [4, 5, 6, 7, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="not in the mesh"):
        host_rows(16, logical, [8])


def test_block_batches_with_host_rows_split_each_global_batch():
    blocks = torch.arange(96).view(48, 2)
    whole = list(data.BlockBatches(blocks, 16, seed=3).epoch(1))
    logical = GRIDS["sharding_groups"]
    for hosts in (1, 2, 4):
        rows = [host_rows(16, logical, blocks_of(hosts, h)) for h in range(hosts)]
        parts = [list(data.BlockBatches(blocks, 16, seed=3, rows=r).epoch(1)) for r in rows]
        for i, batch in enumerate(whole):
            rebuilt = torch.empty_like(batch)
            for r, part in zip(rows, parts):
                assert part[i].shape == (16 // hosts, 2)
                rebuilt[r] = part[i]
            assert torch.equal(rebuilt, batch)
    with pytest.raises(ValueError, match="positions 0..15"):
        data.BlockBatches(blocks, 16, rows=[0, 16])
    with pytest.raises(ValueError, match="one process per host"):
        data.BlockBatches(blocks, 16, world=2, rows=[0, 1])


def test_one_process_per_chip_and_one_host_keep_todays_batches():
    from xla_fsdp.train import job

    assert job._host_batches(False, object()) is None  # non-SPMD: no host splitting at all
    blocks = torch.arange(40).view(20, 2)
    today = list(data.BlockBatches(blocks, 4, seed=1).epoch(0))
    again = list(data.BlockBatches(blocks, 4, seed=1, rows=None).epoch(0))
    assert all(torch.equal(a, b) for a, b in zip(today, again))


# ------------------------------------------------------------------ virtual hosts against one host
def _env(hosts: int, index: int, port: int) -> dict:
    return vh.host_env(hosts, index, port, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"single": the one-host report, 0 / 1: each virtual host's}, all started at once."""
    root = tmp_path_factory.mktemp("per_host")
    port = vh.free_port()
    jobs = {"single": _env(1, 0, port), 0: _env(2, 0, port), 1: _env(2, 1, port)}
    vh.finish(vh.start({k: ([sys.executable, SCRIPT, str(root / f"{k}.pt")], env) for k, env in jobs.items()},
                       cwd=HERE), 240)
    return {k: torch.load(root / f"{k}.pt", weights_only=False) for k in jobs}


def _same_shards(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[d], b[d]) for d in a)


def test_torch_xla_puts_each_row_where_device_rows_says(runs):
    for name, mesh in runs["single"]["meshes"].items():
        for batch, placed in mesh["placement"].items():
            want = device_rows(batch, np.array(mesh["logical"]))
            assert placed == {f"CPU:{d}": span for d, span in want.items()}, name


def test_two_virtual_hosts_build_the_single_hosts_global_batches(runs):
    single = runs["single"]
    assert single["hosts"] == 1 and [runs[h]["devices"] for h in (0, 1)] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    for h in (0, 1):
        for name, mesh in runs[h]["meshes"].items():
            ref = single["meshes"][name]
            for run in ("whole", "resumed"):
                got, want = mesh[run]["steps"], ref[run]["steps"]
                assert len(got) == len(want) == cases.STEPS - (cases.RESUME if run == "resumed" else 0)
                for step, (g, w) in enumerate(zip(got, want)):
                    assert len(g["global"]) == cases.ACCUMULATE
                    for x, y in zip(g["global"], w["global"]):
                        assert x.shape == (cases.GLOBAL, cases.WIDTH) and torch.equal(x, y), (h, name, run, step)
                    assert g["spec"] == w["spec"]
                    assert all(_same_shards(a, b) for a, b in zip(g["shards"], w["shards"]))
            assert torch.equal(mesh["padded"]["global"], ref["padded"]["global"]), (h, name)
            assert _same_shards(mesh["padded"]["shards"], ref["padded"]["shards"]), (h, name)


def test_each_virtual_host_reads_only_its_rows(runs):
    single = runs["single"]
    # the 2-D mesh's device order [[0, 2], [1, 3]] gives host 0 (devices 0, 1) tiles 0 and 2
    assert [runs[h]["meshes"]["2d"]["rows"] for h in (0, 1)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for name in single["meshes"]:
        for run in ("whole", "resumed"):
            ref = single["meshes"][name][run]["reads"]
            hosts = [runs[h]["meshes"][name][run]["reads"] for h in (0, 1)]
            assert len(hosts[0]) == len(hosts[1]) == len(ref) > 0
            for i, want in enumerate(ref):
                assert len(want) == cases.GLOBAL
                for h in (0, 1):
                    rows = runs[h]["meshes"][name]["rows"]
                    assert hosts[h][i] == [want[p] for p in rows], (name, run, h, i)
            for h in (0, 1):  # the local batches are those rows of the global ones
                rows = runs[h]["meshes"][name]["rows"]
                for step in runs[h]["meshes"][name][run]["steps"]:
                    for local, glob in zip(step["local"], step["global"]):
                        assert local.shape[0] == cases.GLOBAL // 2 and torch.equal(local, glob[rows])


def test_a_resumed_host_sees_the_uninterrupted_batches(runs):
    for who in ("single", 0, 1):
        for name, mesh in runs[who]["meshes"].items():
            whole, resumed = mesh["whole"], mesh["resumed"]
            assert whole["done"] == resumed["done"] == cases.STEPS
            tail = whole["steps"][cases.RESUME:]
            assert len(resumed["steps"]) == len(tail) > 0
            for a, b in zip(resumed["steps"], tail):
                assert all(torch.equal(x, y) for x, y in zip(a["local"], b["local"])), (who, name)
                assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"])), (who, name)


# ------------------------------------------------------------------ run_clm on two virtual hosts
@pytest.mark.slow  # about 75 s on two cores: three GPT-2 jobs
def test_run_clm_on_two_virtual_hosts_logs_the_single_hosts_losses(tmp_path):
    """The job's wiring (xla_fsdp/train/job.py): each virtual host reads its rows of every train and
    eval batch; the first host logs the single host's losses and eval loss exactly and exports the
    model (gathered from both hosts)."""
    import json

    root = os.path.dirname(HERE)
    flags = ["--config_name", os.path.join(root, "configs", "models", "gpt2-tiny.json"), "--fsdp", "full_shard",
             "--fsdp_config", os.path.join(root, "configs", "fsdp", "tiny_cpu_v2.json"), "--do_train", "--do_eval",
             "--max_steps", "3", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
             "--block_size", "32", "--logging_steps", "1", "--learning_rate", "3e-3"]
    port = vh.free_port()
    jobs = {"single": _env(1, 0, port), 0: _env(2, 0, port), 1: _env(2, 1, port)}
    outs = vh.finish(vh.start({k: ([sys.executable, os.path.join(root, "launch", "run_clm.py"), "--output_dir",
                                    str(tmp_path / str(k))] + flags, env) for k, env in jobs.items()}, cwd=root), 600)
    got = {k: json.loads((tmp_path / str(k) / "metrics.json").read_text()) for k in ("single", 0)}
    assert got[0]["losses"] == got["single"]["losses"] and len(got[0]["losses"]) == 3
    assert got[0]["eval_loss"] == got["single"]["eval_loss"]
    # the first host logs and writes; the other one trains silently
    assert not (tmp_path / "1" / "metrics.json").exists() and "run_clm:" not in outs[1]
    assert "run_clm:" in outs[0] and (tmp_path / "0" / "model.safetensors").exists()
