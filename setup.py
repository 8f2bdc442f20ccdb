"""snip-megatron: adaptive per-layer FP8/FP4 mixed precision for Megatron-Core pretraining."""

from setuptools import find_packages, setup

setup(
    name="snip-megatron",
    version="0.1.0",
    description="SNIP: per-layer FP8/FP4 precision plans for Megatron-Core pretraining",
    packages=find_packages(include=["snip_megatron", "snip_megatron.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.13",
        "megatron-core>=0.16.1",
        "pulp>=3.3.2",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy",
        "pyyaml",
        "tokenizers",
        "tqdm",
        "matplotlib",
        "psutil",  # Megatron's checkpoint writer logs process memory with it
    ],
    extras_require={
        # GPU only: never install these on a CPU machine (a half-installed TE breaks megatron.core).
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "test": ["pytest", "pytest-timeout", "torchao==0.18.0"],
    },
    entry_points={"console_scripts": [
        "snip-train = snip_megatron.cli.train:cli",
        "snip-pretrain-gpt = snip_megatron.megatron.pretrain_gpt:cli",
    ]},
)
