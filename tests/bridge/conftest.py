"""Bridge lane (Megatron-Bridge 0.6.2, no Transformer Engine): the lora_layers stand-in goes in
before anything imports megatron.bridge, and `bridge_on_cpu` runs Bridge's pretrain() in this
process on CPU (gloo, one rank; tests/bridge/cpu.py says what it patches)."""

from __future__ import annotations

import os
import sys

import pytest

# tests/bridge on the path for this lane only, so `te_stub` (test code, not the package) imports.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from te_stub import lora_layers as _lora_layers_stand_in  # noqa: E402

_lora_layers_stand_in.install()


@pytest.fixture
def bridge_on_cpu():
    """Bridge's pretrain() on a CPU in this process; SNIP's train_step seam and active run are
    cleared afterwards, so every test starts from Bridge as installed."""
    from tests.bridge import cpu

    cpu.install()
    try:
        yield
    finally:
        from snip_megatron.bridge import run, seams

        seams.uninstall()
        run.deactivate(run.active())
        cpu.uninstall()
