"""Shared fixtures: a single-process Megatron runtime (gloo, CPU shim) for in-process tests."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore")

# tests/bridge needs Megatron-Bridge, which only the bridge lane installs: the other lanes do not
# collect it (scripts/run_tests.sh passes each lane its paths; this covers a plain `pytest`).
def _has_megatron_bridge() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ImportError:  # no megatron namespace at all
        return False


if not _has_megatron_bridge():
    collect_ignore = ["bridge"]


@pytest.fixture
def megatron_single():
    """Parallel state for one process (TP=PP=DP=1); torn down after the test."""
    from snip_megatron.megatron import runtime

    runtime.init_process_group()
    runtime.initialize_model_parallel(tp=1, pp=1)
    yield
    runtime.destroy()
