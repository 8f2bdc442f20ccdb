"""bench/gpu/emulation_cuda_check.py's helpers (its whole logic runs on CPU in
tests/megatron/test_apply.py::test_gpu_check_script_logic_on_cpu)."""

import importlib.util
import sys

import pytest

from tests.distributed import ROOT


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("bench_emulation_cuda_check",
                                                  ROOT / "bench" / "gpu" / "emulation_cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_emulation_cuda_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_emulation_cuda_check", None)


def test_the_timed_plans_cover_fp8_and_each_fp4_recipe(check):
    from snip_megatron.formats.precision import Precision

    plans = check.timed_plans(["nvfp4", "mxfp4"])
    assert [(label, p) for label, p, _ in plans] == [("bf16", Precision.BF16), ("fp8", Precision.FP8),
                                                     ("nvfp4", Precision.FP4), ("mxfp4", Precision.FP4)]
    assert plans[2][2].spec(Precision.FP4) != plans[3][2].spec(Precision.FP4)  # the two FP4 recipes differ
    assert check.ratios({"bf16": 2.0, "fp8": 3.0, "nvfp4": 9.0}) == "fp8:1.50,nvfp4:4.50"
    assert check.ratios({"fp8": 3.0}) == "-" and check.ratios({}) == "-"


def test_arguments(check):
    assert check.parse_fp4_recipes("mxfp4, nvfp4,mxfp4") == ["mxfp4", "nvfp4"]
    with pytest.raises(ValueError, match="choose from nvfp4, mxfp4"):
        check.parse_fp4_recipes("fp4")
    assert check.parse_timing_shape("8192,8192,7168") == check.TIMING_SHAPE
    for bad in ("1,2", "a,b,c", "0,1,1"):
        with pytest.raises(ValueError, match="--timing-shape"):
            check.parse_timing_shape(bad)
    with pytest.raises(SystemExit, match="no CUDA device: run with --device cpu"):
        check.main([])  # this machine has no GPU
    with pytest.raises(SystemExit) as bad:
        check.main(["--device", "cpu", "--fp4-recipes", "int4"])
    assert bad.value.code == 2


def test_steps_are_timed_on_a_bf16_model(check, monkeypatch):
    # step_x compares emulated steps with BF16 ones of a model with BF16 parameters (not FP32 GEMMs)
    import torch

    class Built(Exception):
        pass

    def build(shape, config, plan, device):
        raise Built(config.params_dtype, config.bf16, {p: n for p, n in plan.counts().items() if n})

    monkeypatch.setattr(check, "build", build)
    with pytest.raises(Built) as built:
        check.time_steps(check.TINY, 1, False, ["nvfp4"], torch.device("cpu"), 1, [])
    dtype, bf16, counts = built.value.args
    assert dtype is torch.bfloat16 and bf16 and counts == {"bf16": 16}
