"""snip-megatron: adaptive per-layer FP8/FP4 mixed precision for Megatron-Core pretraining."""

from setuptools import find_packages, setup

setup(
    name="snip-megatron",
    version="0.1.0",
    description="SNIP: per-layer FP8/FP4 precision plans for Megatron-Core pretraining",
    packages=find_packages(include=["snip_megatron", "snip_megatron.*"]),
    # The CPU quantizer's C++ source, compiled on first use (snip_megatron/formats/cpu_kernel.py).
    package_data={"snip_megatron.formats": ["csrc/*.cpp"]},
    python_requires=">=3.11",
    install_requires=[
        # Tested: 2.13.0 and 2.14.1. Written with "a0" so NGC's pre-release builds
        # (2.13.0a0+<commit>.nv26.06) qualify: under PEP 440 2.13.0a0 < 2.13, and a specifier
        # without a pre-release admits none.
        "torch>=2.13.0a0",
        "megatron-core>=0.16.1",
        # compat: the planner's ILP solver by Python version. PuLP >= 4 (Python >= 3.12) ships CBC
        # only in its `cbc` extra (the cbcbox wheel); PuLP 3.x (the line Python 3.11 gets) bundles
        # the CBC binary.
        'pulp[cbc]>=4.2; python_version >= "3.12"',
        'pulp>=3.3.2,<4; python_version < "3.12"',
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
        # GPU only: never install this on a CPU machine (a half-installed TE breaks megatron.core).
        # TE's PyTorch extension as TE publishes it (an sdist built against the local torch and
        # CUDA; TE recommends `pip install --no-build-isolation`); 2.9 brought the NVFP4 recipe.
        # NVIDIA apex is not here: it is not on PyPI (the PyPI `apex` is an unrelated project);
        # the NGC PyTorch image ships it, and SNIP does not need it (docs/getting-started.md, Install).
        "gpu": ["transformer-engine[pytorch]>=2.9"],
        "test": ["pytest", "pytest-timeout", "torchao==0.18.0"],
    },
    entry_points={"console_scripts": [
        "snip-train = snip_megatron.cli.train:cli",
        "snip-pretrain-gpt = snip_megatron.pretrain.entry:cli",
        "snip-pretrain-hybrid = snip_megatron.pretrain.entry:cli_hybrid",
        "snip-bridge-pretrain = snip_megatron.bridge.cli:cli",
        "snip-analyze = snip_megatron.analyze.cli:cli",
    ]},
)
