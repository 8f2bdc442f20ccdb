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
    assert (args.layers, args.hidden, args.heads, args.groups, args.steps, args.prefix_steps, args.jobs) == \
        (12, 512, 8, 4, 800, 500, 8)
    assert args.out.endswith("results_gpu.md") and args.argv[:2] == ["--layers", "12"] and args.resume
    assert quality.parse_args(gpu.gpu_argv(["--steps", "3000", "--jobs", "2"])).steps == 3000
    # the subset: BF16, uniform FP4, the recipe, the CPU run's best rule and SNIP, at 80%, 3 seeds
    best = gpu.best_cpu_rule()
    assert best in quality.HEURISTICS
    specs = quality.build_specs(args)
    assert {(s.method, s.budget) for s in specs} == {("bf16", None), ("uniform_fp4", None), ("last_fraction", 0.8),
                                                     (best, 0.8), ("snip_periodic", 0.8)}
    assert len(specs) == 3 * len({s.method for s in specs}) and not quality.wants_oracle(args)
    own = quality.parse_args(gpu.gpu_argv(["--methods", "snip_once"]))
    assert {s.method for s in quality.build_specs(own)} == {"bf16", "snip_once"}


def test_the_best_rule_is_the_cpu_logs_smallest_gap(modules, tmp_path):
    gpu, _ = modules
    log = tmp_path / "log.jsonl"
    rows = [("bf16", None, 4.0), ("first_last_k", 0.8, 4.02), ("random", 0.8, 4.01), ("random", 0.75, 3.0),
            ("snip_periodic", 0.8, 3.9)]
    import json

    log.write_text("".join(json.dumps({"spec": {"method": m, "budget": b, "seed": 0, "fp4_recipe": "nvfp4"},
                                       "val_bf16": v, "val_plan": v, "fp4_fraction": 0.8, "diverged": False}) + "\n"
                           for m, b, v in rows))
    assert gpu.best_cpu_rule(log) == "random"  # SNIP is not a rule; other budgets do not count
    with pytest.raises(SystemExit, match="missing"):
        gpu.best_cpu_rule(tmp_path / "none.jsonl")
    with pytest.raises(SystemExit, match="no fixed rule at nvfp4 90%"):
        gpu.best_cpu_rule(log, budget=0.9)


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


def test_device_cpu_runs_the_same_command_on_a_cpu(modules, monkeypatch):
    gpu, quality = modules
    seen = []
    monkeypatch.setattr(quality, "main", seen.append)
    gpu.main(["--device", "cpu", "--seeds", "1"])
    assert seen == [gpu.gpu_argv(["--seeds", "1"])]  # --device taken out, the rest as on a GPU
    with pytest.raises(SystemExit, match="cuda or cpu"):
        gpu.main(["--device", "tpu"])
