"""Packaging for xla_fsdp. Pins live in requirements.txt (torch and torch_xla must match)."""
from setuptools import find_packages, setup

setup(
    name="xla_fsdp",
    version="0.1.0",
    description="Fully sharded data parallel training for PyTorch/XLA (TPU first, CPU testable)",
    packages=find_packages(include=["xla_fsdp", "xla_fsdp.*"]),
    python_requires=">=3.10",
    # fsspec: checkpoints at URLs (xla_fsdp/checkpoint/storage.py); torch requires it as well
    install_requires=["torch==2.9.0", "torch_xla==2.9.0", "numpy", "fsspec"],
    extras_require={
        "hf": ["transformers==5.23.0", "tqdm"],
        "test": ["pytest", "gcsfs==2026.10.1", "gcp-storage-emulator==2026.7.19"],  # requirements-test.txt
        # checkpoints at gs:// URLs (fsspec's Google Cloud Storage file system)
        "gcs": ["gcsfs"],
        # the ahead-of-time check (`python -m xla_fsdp.aot`): libtpu's compiler, no TPU needed;
        # the versions torch_xla 2.9 pins for its tpu and pallas extras
        "tpu-aot": ["libtpu==0.0.21", "jax==0.7.1", "jaxlib==0.7.1"],
    },
)
