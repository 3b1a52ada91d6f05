"""FSDP2's DCP checkpoints across hosts ([Note: DCP across hosts] in xla_fsdp/fsdp/dcp.py), proven
with virtual hosts ([Note: virtual hosts] in xla_fsdp/runtime/hosts.py): processes on this machine
act as the hosts of one slice of 8 devices, each a DCP rank through the `xla://` process group.

tests/fsdp2/pods_worker.py trains tests/fsdp2/dcp_worker.py's small Llama (fully_shard per layer and
root; vocab 67: padding rows at 8 devices) 2 steps at 2 hosts x 4 devices and DCP-saves model and
AdamW state; then host 1 is SIGKILLed in a second save over that complete checkpoint, after its
data and before DCP's metadata. Default run: the files (each host wrote the rows of its own devices,
every row once), the killed save (nothing loads from it; the step-2 checkpoint still does), a load at
2 hosts (state exact, every tensor sharded as before, the next step's loss the uninterrupted run's,
each host reading only its devices' rows) and into plain CPU tensors through DCP alone. `-m slow`: 1
host of 8 devices, 1 host of 4 devices, an HSDP mesh with the replica dim across the hosts, a
checkpoint of 1 host loaded at 2.
"""
from __future__ import annotations

import math
import os
import re
import signal
import sys

import pytest
import torch

import virtual_hosts as vh

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp2", "pods_worker.py")
DEVICES = 8
K = 2  # pods_worker.K
EXACT = 0.0  # copies of the same values
LOSS_TOL = 1e-5  # another device count reorders sums (fp32)


def _start(mode: str, root: str, out: str, hosts: int, devices: int = DEVICES, mesh: str = "default"):
    port = vh.free_port()
    return vh.start({i: ([sys.executable, WORKER, mode, root, out, mesh], vh.host_env(hosts, i, port, devices))
                     for i in range(hosts)})


def _results(out: str, hosts: int) -> list:
    return [torch.load(f"{out}-host{h}.pt", weights_only=False) for h in range(hosts)]


def _save(tmp, hosts: int, devices: int = DEVICES, mesh: str = "default") -> dict:
    """Run the save; with 2 hosts host 1 dies in the second save and host 0 must fail, not hang."""
    root, out = str(tmp / "ckpt"), str(tmp / "saved")
    procs = _start("save", root, out, hosts, devices, mesh)
    try:
        logs = {i: p.communicate(timeout=600)[0] for i, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    codes = {i: p.returncode for i, p in procs.items()}
    want = {0: 3, 1: -signal.SIGKILL} if hosts == 2 else {i: 0 for i in range(hosts)}
    assert codes == want, f"exit codes {codes}, expected {want}:\n" + "\n".join(
        f"-- host {i}\n{log[-3000:]}" for i, log in logs.items())
    return {"root": root, "logs": logs, "hosts": hosts, "devices": devices, "mesh": mesh, "results": _results(out, hosts)}


def _load(tmp, saved: dict, hosts: int, devices: int = DEVICES, mesh: str = "default") -> list:
    out = str(tmp / f"loaded-{hosts}x{devices}-{mesh}")
    vh.finish(_start("load", saved["root"], out, hosts, devices, mesh), 600)
    return _results(out, hosts)


def held_rows(rows: int, host: int, hosts: int, devices: int = DEVICES, mesh: str = "default") -> range:
    """The rows of a `rows`-row tensor on `host`'s devices: dim-0 blocks over every device, or with
    the HSDP mesh (hosts, devices // hosts) every row on every host (each host's devices shard it)."""
    if mesh == "hsdp" or hosts == 1:
        return range(rows)
    per = math.ceil(rows / devices)
    mine = devices // hosts
    return range(min(host * mine * per, rows), min((host + 1) * mine * per, rows))


def written_rows(rows: int, host: int, hosts: int, devices: int = DEVICES, mesh: str = "default") -> list:
    """The rows `host` writes of a `rows`-row tensor, as ranges: its own devices' rows, and with the
    HSDP mesh, where every host holds every row, only the blocks whose turn is its own ([Note: who
    writes a row]: the block of shard rows starting at row b * per is written by copy b mod R; the
    copies are the hosts, R = hosts, per = ceil(rows / (devices // hosts)))."""
    if mesh != "hsdp" or hosts == 1:
        return [held_rows(rows, host, hosts, devices, mesh)]
    per = math.ceil(rows / (devices // hosts))
    return [range(b * per, min((b + 1) * per, rows)) for b in range(devices // hosts)
            if b % hosts == host and b * per < rows]


def written_chunks(path: str) -> dict:
    """{key: [(host, first row, last row + 1, bytes in its file, elements)]} from DCP's metadata,
    tensors only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        tensor = md.state_dict_metadata[index.fqn]
        if not isinstance(tensor, TensorStorageMetadata):
            continue
        host = int(re.match(r"__(\d+)_", info.relative_path).group(1))
        chunk = next(c for c in tensor.chunks if tuple(c.offsets) == tuple(index.offset))
        start, count = (chunk.offsets[0], chunk.sizes[0]) if len(tensor.size) else (0, 1)
        out.setdefault(index.fqn, []).append((host, start, start + count, info.length, math.prod(chunk.sizes)))
    return out


def _scalar(key: str) -> bool:
    return key.endswith(".step")  # AdamW's counters: CPU scalars, replicated (any one host writes them)


def max_diff(a, b) -> float:
    """Largest abs difference between two nested state dicts (inf where keys, shapes or a
    non-tensor value differ)."""
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or set(a) != set(b):
            return math.inf
        return max([max_diff(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return math.inf
        return max([max_diff(x, y) for x, y in zip(a, b)], default=0.0)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return math.inf
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return 0.0 if a == b else math.inf


def _rows_of(key: str, ref: dict) -> int:
    """Rows of checkpoint key `key` ("model.<name>", "optim.state.<name>.<state>") in the reference."""
    kind, rest = key.split(".", 1)
    if kind == "model":
        t = ref["model"][rest]
    else:
        name, state = rest[len("state."):].rsplit(".", 1)
        t = ref["optim"]["state"][name][state]
    return t.shape[0] if t.dim() else 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("fsdp2_pods"), hosts=2)


def _check_files(saved: dict) -> None:
    """Every row of every tensor once, each in the file of a host whose devices hold it; both hosts
    write a share of every sharded tensor."""
    ref = saved["results"][0]["ref"]
    path = os.path.join(saved["root"], f"step-{K}")
    chunks = written_chunks(path)
    assert {k for k in chunks if k.startswith("model.")} == {f"model.{k}" for k in ref["model"]}
    per_host = {}  # host -> [file bytes, elements] of the sharded tensors' chunks
    for key, pieces in chunks.items():
        rows = _rows_of(key, ref)
        pieces.sort(key=lambda p: p[1])
        at = 0
        for host, start, stop, nbytes, elements in pieces:
            assert start == at, f"{key}: rows {at}..{start} missing or written twice ({pieces})"
            allowed = [range(1)] if _scalar(key) else written_rows(rows, host, saved["hosts"], saved["devices"],
                                                                    saved["mesh"])
            assert any(r.start <= start and stop <= r.stop for r in allowed), \
                f"{key}: host {host} wrote {start}..{stop}, not its rows {allowed}"
            at = stop
            if not _scalar(key):
                per_host.setdefault(host, [0, 0])[0] += nbytes
                per_host[host][1] += elements
        assert at == rows, f"{key}: {at} of {rows} rows saved"
        if not _scalar(key) and saved["hosts"] == 2:  # a sharded tensor: each host wrote its part
            assert {h for h, *_ in pieces} == {0, 1}, (key, pieces)
    files = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}
    print(f"sharded tensors' chunks per host [bytes in the file, elements]: {per_host}; files {files}")
    for r in saved["results"]:
        print(f"host {r['host']}: save {r['save_seconds']:.2f} s; moved from the devices {r['moved']}")


def test_each_host_writes_the_rows_of_its_own_devices_once(saved):
    _check_files(saved)


def test_a_host_killed_mid_save_leaves_no_checkpoint_that_loads(saved, tmp_path):
    """Host 1 died after writing its data of the second save to `latest`, before DCP's metadata:
    the first save's metadata is gone (the writer deletes it before any data is written), host 0
    failed instead of waiting, and DCP refuses to load `latest`; step-2 still loads (the tests
    below load it)."""
    import torch.distributed.checkpoint as dcp

    from xla_fsdp.fsdp.dcp import is_complete, storage_reader

    latest = os.path.join(saved["root"], "latest")
    assert sorted(os.listdir(latest)) == ["__0_0.distcp", "__1_0.distcp"], os.listdir(latest)
    assert not is_complete(latest) and is_complete(os.path.join(saved["root"], f"step-{K}"))
    failed = re.search(r"host 0: the second save failed after ([0-9.]+) s: (.*)", saved["logs"][0])
    assert failed, saved["logs"][0][-2000:]
    print(f"host 0 failed {failed.group(1)} s into the save: {failed.group(2)[:200]}")
    ref = saved["results"][0]["ref"]["model"]
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # DCP finds no metadata (here: "assert metadata is not None")
        dcp.load({"model": {k: torch.empty_like(v) for k, v in ref.items()}}, storage_reader=storage_reader(latest))


def _check_loaded(saved: dict, loaded: list, devices: int, mesh: str = "default", exact_loss: bool = True) -> None:
    ref = saved["results"][0]
    hosts = len(loaded)
    for got in loaded:
        if saved["hosts"] == 2:  # host 1 was killed in the second save: `latest` must not load
            assert got["killed_save"] is not None and "CheckpointException" in got["killed_save"], got["killed_save"]
        else:  # one host finished its second save: `latest` loads
            assert got["killed_save"] is None, got["killed_save"]
        assert got["step"] == K and got["devices_total"] == devices
        diff = max_diff(ref["ref"], got["got"])
        assert diff <= EXACT, f"host {got['host']}: max abs difference {diff}"
        assert got["specs"] == [], got["specs"]
        loss_diff = abs(got["next_loss"] - ref["next_loss"])
        print(f"{hosts} host(s) x {devices // hosts} devices: host {got['host']} loaded in {got['load_seconds']:.2f} s, "
              f"next loss {got['next_loss']!r} vs {ref['next_loss']!r} (diff {loss_diff:.3g})")
        assert loss_diff <= (EXACT if exact_loss else LOSS_TOL), (got["next_loss"], ref["next_loss"])
        read, covered = 0, {}
        for key, start, stop in got["reads"]:
            rows = _rows_of(key, ref["ref"])
            inside = range(1) if _scalar(key) else held_rows(rows, got["host"], hosts, devices, mesh)
            assert inside.start <= start and stop <= inside.stop, f"host {got['host']} read {key} {start}..{stop}"
            covered.setdefault(key, set()).update(range(start, stop))
            read += stop - start
        for key, seen in covered.items():  # every row its devices hold was read (HSDP: every row)
            rows = _rows_of(key, ref["ref"])
            want = set(range(1)) if _scalar(key) else set(held_rows(rows, got["host"], hosts, devices, mesh))
            assert seen == want, f"host {got['host']} read rows {sorted(seen)[:8]}... of {key}, expected {len(want)} rows"
        print(f"  host {got['host']} read {len(got['reads'])} chunks, {read} rows")


def test_loads_at_2_hosts(saved, tmp_path):
    _check_loaded(saved, _load(tmp_path, saved, hosts=2), DEVICES)


# -m slow: a load at 2 hosts (each host reading only its devices' rows) stays in the default run; a DCP
# checkpoint at another layout: tests/test_fsdp2_dcp.py (4 devices loaded at 1); at another host count:
# tests/test_pod_checkpoints.py (xla_fsdp's checkpoints, 2 hosts loaded at 4)
@pytest.mark.slow
def test_loads_at_1_host_of_8_devices(saved, tmp_path):
    _check_loaded(saved, _load(tmp_path, saved, hosts=1), DEVICES)


def test_loads_into_plain_cpu_tensors_through_dcp_alone(saved, tmp_path):
    """`dcp.load` into a state dict of CPU tensors (no XLA, no process group) and
    `dcp_to_torch_save` give the saved model and optimizer state exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = saved["results"][0]["ref"]
    path = os.path.join(saved["root"], f"step-{K}")
    plain = {"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()}}
    dcp.load(plain, checkpoint_id=path)
    assert max_diff(ref["model"], plain["model"]) <= EXACT
    dcp_to_torch_save(path, str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert max_diff(ref["model"], whole["model"]) <= EXACT
    assert max_diff(ref["optim"]["state"], whole["optim"]["state"]) <= EXACT
    assert whole["step"] == K


@pytest.mark.slow
def test_loads_at_1_host_of_4_devices(saved, tmp_path):
    _check_loaded(saved, _load(tmp_path, saved, hosts=1, devices=4), 4, exact_loss=False)


@pytest.mark.slow
@pytest.mark.parametrize("load_hosts", [2, 1])
def test_hsdp_with_the_replica_dim_across_hosts(tmp_path_factory, load_hosts):
    """Mesh (hosts, 1) (dp_replicate x dp_shard over processes): each host holds every row; the
    copies take turns block by block ([Note: who writes a row]), so both hosts write."""
    tmp = tmp_path_factory.mktemp("hsdp")
    hsdp = _save(tmp, hosts=2, mesh="hsdp")
    _check_files(hsdp)
    _check_loaded(hsdp, _load(tmp, hsdp, hosts=load_hosts, mesh="hsdp"), DEVICES, "hsdp")


@pytest.mark.slow
def test_a_checkpoint_of_one_host_loads_at_2(tmp_path):
    one = _save(tmp_path, hosts=1)
    _check_loaded(one, _load(tmp_path, one, hosts=2), DEVICES)
