"""run_clm's --output_dir: checked before the runtime starts, left as found when a start fails, and where metrics.json
is written (a local path or a bucket URL)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil

from xla_fsdp import abstract


def check_output_dir(args) -> None:
    """Hugging Face's run_clm semantics: a non-empty --output_dir is refused unless --overwrite_output_dir is given, or
    it holds a checkpoint to resume from (which, without --resume_from_checkpoint, is then resumed: the preempted job's
    restart). A URL (gs://bucket/run) is checked through its fsspec file system, bucket included."""
    d = args.output_dir
    st = output_storage(d)
    if st.exists(d) and not st.isdir(d):
        raise SystemExit(f"--output_dir {d} exists and is a file; give a directory path")
    from xla_fsdp.checkpoint.filesystems import is_url

    if not is_url(d):  # found now, not when the first checkpoint or metrics.json is written
        above = os.path.abspath(d)
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise SystemExit(f"--output_dir {d}: {above} is a file, so the directory cannot be made; "
                             "give a path under a directory")
        if not os.access(above, os.W_OK | os.X_OK):
            raise SystemExit(f"--output_dir {d}: {above} is not writable by this user; give a directory "
                             "you can write to")
    if args.do_train and st.listdir(d) and not args.overwrite_output_dir:
        from xla_fsdp.checkpoint import latest_checkpoint

        last = latest_checkpoint(d)
        if last is None and args.resume_from_checkpoint is None:
            raise SystemExit(f"--output_dir {d} already exists and is not empty; "
                             f"add --overwrite_output_dir to reuse it, or pick another directory")
        if args.resume_from_checkpoint is None:
            print(f"run_clm: checkpoint detected in {d}; resuming from {last} "
                  "(add --overwrite_output_dir to train from scratch)")
            args.resume_from_checkpoint = last


def output_storage(d):
    """The storage --output_dir lives on: the local disk, or the fsspec file system of a URL (never a local folder named
    `gs:`). A missing file system or bucket ends the job here."""
    from xla_fsdp.checkpoint import storage

    try:
        st = storage.storage_for(d)
        storage.check_bucket(d)
    except (ImportError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--output_dir: {e}") from None
    return st


def write_metrics(report: dict, output_dir: str) -> str:
    """metrics.json into --output_dir (a path or a URL); returns where it went."""
    st = output_storage(output_dir)
    st.makedirs(output_dir, exist_ok=True)
    path = st.join(output_dir, "metrics.json")
    st.write_bytes(path, json.dumps(report, indent=2).encode())
    return path


@contextlib.contextmanager
def written_only_on_success(output_dir: str):
    """[Note: a start that fails writes nothing] A job that ends before its first step (a mistake in its flags or files
    found after the runtime started: an engine keyword the model cannot take, a batch the text cannot fill) leaves
    --output_dir as it found it: the folder, or the compile_cache/ folder in it, removed when this run made them. Local
    paths only (the compile cache lives only under a local --output_dir); a bucket is never touched."""
    from xla_fsdp.checkpoint.filesystems import is_url

    made = []
    if not is_url(output_dir) and not abstract.active():
        top = os.path.abspath(output_dir)
        while not os.path.exists(top) and os.path.dirname(top) != top:
            made = [top]  # the outermost folder this run would create
            top = os.path.dirname(top)
        cache = os.path.join(output_dir, "compile_cache")
        if not made and not os.path.exists(cache):
            made = [cache]
    try:
        yield
    except BaseException:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        raise
