"""bench/gpu/quality_gpu.py: its defaults reach bench/quality.py, the user's flags win, no CUDA is refused."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def modules():
    gpu = load("bench_quality_gpu", ROOT / "bench" / "gpu" / "quality_gpu.py")
    quality = load("quality", ROOT / "bench" / "quality.py")  # the name quality_gpu imports
    yield gpu, quality
    for name in ("bench_quality_gpu", "quality"):
        sys.modules.pop(name, None)


def test_gpu_defaults_and_overrides(modules):
    gpu, quality = modules
    args = quality.parse_args(gpu.gpu_argv([]))
    assert (args.layers, args.hidden, args.heads, args.groups, args.steps, args.jobs) == (12, 512, 8, 4, 1000, 8)
    assert args.out.endswith("results_gpu.md") and args.argv[:2] == ["--layers", "12"]
    assert quality.parse_args(gpu.gpu_argv(["--steps", "3000", "--jobs", "2"])).steps == 3000
    quick = quality.parse_args(gpu.gpu_argv(["--quick"]))
    assert (quick.steps, quick.prefix_steps) == (400, 200) and args.prefix_steps == 500


def test_gpu_model_is_a_valid_layout_with_whole_quantization_blocks(modules):
    from snip_megatron.megatron.model import validate_layout
    from snip_megatron.shapes import ModelShape

    gpu, quality = modules
    args = quality.parse_args(gpu.gpu_argv([]))
    spec = quality.build_specs(args)[0]
    shape = ModelShape(**spec.model)
    for tp in (1, 2, 4):
        validate_layout(shape, tp=tp)
    assert all(d % 128 == 0 for d in (shape.hidden_size, shape.ffn_hidden_size))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda(modules):
    gpu, _ = modules
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu.main([])
