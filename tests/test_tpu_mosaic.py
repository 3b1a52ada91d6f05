"""The Mosaic IR version cap ([Note: Mosaic IR version for libtpu 0.0.21] in xla_fsdp/tpu/mosaic.py):
libtpu 0.0.21 accepts 7, jax 0.7.1 writes 8 unless told; the facts the note cites still hold."""
from __future__ import annotations

import importlib.util
import inspect
import mmap
import os

import pytest

from xla_fsdp.tpu import mosaic


def test_jaxs_choice_is_capped_at_what_libtpu_accepts():
    assert mosaic.accepted_version("0.0.21") == 7
    assert mosaic.capped(None, 7) == 7       # None: jaxlib's newest (8 in jaxlib 0.7.1)
    assert mosaic.capped(5, 7) == 5          # an older TPU's choice stands
    assert mosaic.capped(None, None) is None  # a libtpu we know nothing of: jax decides
    assert mosaic.accepted_version("9.9.9") is None


@pytest.mark.skipif(importlib.util.find_spec("jax") is None or importlib.util.find_spec("libtpu") is None,
                    reason="jax / libtpu not installed")
def test_the_notes_facts_hold_for_the_installed_jax_and_libtpu():
    from jax._src import cloud_tpu_init, tpu_custom_call

    if mosaic.libtpu_version() != "0.0.21":
        pytest.skip(f"libtpu {mosaic.libtpu_version()} is installed; the note is about 0.0.21")
    source = inspect.getsource(tpu_custom_call.get_ir_version) if not mosaic._pinned else ""
    if source:  # jax's own function, not yet wrapped in this process
        assert "is_cloud_tpu_older_than(2025, 8, 14)" in source and "return 7" in source
    assert "platform_version" in inspect.getsource(cloud_tpu_init.is_cloud_tpu_older_than)
    import libtpu

    with open(os.path.join(os.path.dirname(libtpu.__file__), "libtpu.so"), "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert data.find(b"Built on Aug 15 2025 10:23:31 (1755278611)") >= 0
