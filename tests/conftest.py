"""Shared fixtures: a single-process Megatron runtime (gloo, CPU shim) for in-process tests."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore")


@pytest.fixture
def megatron_single():
    """Parallel state for one process (TP=PP=DP=1); torn down after the test."""
    from snip_megatron.megatron import runtime

    runtime.init_process_group()
    runtime.initialize_model_parallel(tp=1, pp=1)
    yield
    runtime.destroy()
