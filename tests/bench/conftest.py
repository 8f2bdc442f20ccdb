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


def _bench_fixture(fixture: str, module: str, file: str):
    @pytest.fixture(scope="module", name=fixture)
    def load():
        yield from _loaded(module, file)
    return load


quality = _bench_fixture("quality", "bench_quality", "quality.py")
oracle = _bench_fixture("oracle", "bench_quality_oracle", "quality_oracle.py")
regimes = _bench_fixture("regimes", "bench_quality_regimes", "quality_regimes.py")
planner_scale = _bench_fixture("planner_scale", "bench_planner_scale", "planner_scale.py")
fidelity = _bench_fixture("fidelity", "bench_fidelity", "estimator_fidelity.py")
emulation_profile = _bench_fixture("emulation_profile", "bench_emulation_profile", "emulation_profile.py")
measure_scale = _bench_fixture("measure_scale", "bench_measure_scale", "measure_scale.py")
cast_bits_check = _bench_fixture("cast_bits_check", "bench_cast_bits_check", "gpu/cast_bits_check.py")
pretrain_local_check = _bench_fixture("pretrain_local_check", "bench_pretrain_local_check",
                                      "gpu/pretrain_local_check.py")
