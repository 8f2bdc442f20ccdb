"""Bridge lane (Megatron-Bridge 0.6.2, no Transformer Engine): the lora_layers stand-in goes in
before anything imports megatron.bridge, and `bridge_on_cpu` runs Bridge's pretrain() in this
process on CPU (gloo, one rank)."""

from __future__ import annotations

import functools
import os
import sys

import pytest

# tests/bridge on the path for this lane only, so `te_stub` (test code, not the package) imports.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from te_stub import lora_layers as _lora_layers_stand_in  # noqa: E402

_lora_layers_stand_in.install()


@pytest.fixture
def bridge_on_cpu(monkeypatch):
    """Bridge's pretrain() on a CPU: a one-rank gloo process group, the project's CUDA->CPU shim,
    and the three spots where Bridge 0.6.2 assumes a GPU, patched for the test only:

    - `setup` calls `initialize_megatron` without `allow_no_cuda` (it asserts CUDA): passed True;
    - `_set_random_seed` seeds the model-parallel RNG tracker only when it sees a CUDA device, and
      attention forks that tracker: seeded here as well;
    - `compile_helpers` runs `make` in megatron/core/datasets, but the megatron-core wheel ships
      the helpers prebuilt and without the Makefile: compiled only when the import fails.
    """
    import torch.distributed as dist

    from snip_megatron.megatron import cpu_shim, runtime

    runtime.quiet_megatron_warnings()
    runtime.init_process_group(backend="gloo", timeout_s=120.0)
    import megatron.bridge.training.initialize as binit
    import megatron.bridge.training.setup as bsetup
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_shim.install()
    monkeypatch.setattr(bsetup, "initialize_megatron",
                        functools.partial(bsetup.initialize_megatron, allow_no_cuda=True))
    set_random_seed = binit._set_random_seed

    def seed_with_tracker(seed, *args, **kwargs):
        set_random_seed(seed, *args, **kwargs)
        model_parallel_cuda_manual_seed(seed)

    monkeypatch.setattr(binit, "_set_random_seed", seed_with_tracker)
    compile_helpers = binit.compile_helpers

    def compile_unless_prebuilt():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            compile_helpers()

    monkeypatch.setattr(binit, "compile_helpers", compile_unless_prebuilt)
    try:
        yield
    finally:
        runtime.destroy()
        cpu_shim.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
