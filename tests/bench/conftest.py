"""The benchmark scripts under bench/, loaded by path (bench/ is not a package) for their tests."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _loaded(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def quality():
    yield from _loaded("bench_quality", "quality.py")


@pytest.fixture(scope="module")
def oracle():
    yield from _loaded("bench_quality_oracle", "quality_oracle.py")


@pytest.fixture(scope="module")
def regimes():
    yield from _loaded("bench_quality_regimes", "quality_regimes.py")


@pytest.fixture(scope="module")
def fidelity():
    yield from _loaded("bench_fidelity", "estimator_fidelity.py")
