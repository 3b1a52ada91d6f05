"""Packaging for xla_fsdp. Pins live in requirements.txt (torch and torch_xla must match)."""
from setuptools import find_packages, setup

setup(
    name="xla_fsdp",
    version="0.1.0",
    description="Fully sharded data parallel training for PyTorch/XLA (TPU first, CPU testable)",
    packages=find_packages(include=["xla_fsdp", "xla_fsdp.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.9.0", "torch_xla==2.9.0", "numpy"],
    extras_require={"hf": ["transformers==5.23.0", "tqdm"], "test": ["pytest"]},
)
