"""bench/gpu/cast_bits_check.py on CPU: the fused path equals the reference on every recipe, role and
probe (what it checks on a GPU), and a single differing bit is reported with where it is."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "cast_bits_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("bench_cast_bits_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cast_bits_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_cast_bits_check", None)


def test_every_cast_agrees_on_cpu(check):
    n, diffs = check.check(torch.device("cpu"), log=lambda line: None)
    # 3 noise checks; per variant and role: on each of the 2 finite probes 2 paths x (values, codes,
    # scales, tensor scale) and 3 operand checks, on the special probe 2 x values and 3 operand checks
    assert n == 3 + len(check.VARIANTS) * 6 * (2 * (2 * 4 + 3) + (2 * 1 + 3)) == 1299
    assert diffs == []


def test_a_flipped_bit_is_reported(check, monkeypatch):
    real = check.quantize

    def off_by_one_bit(x, cast, **kw):
        out = real(x, cast, **kw)
        if cast.element.value == "e2m1" and cast.hadamard:  # NVFP4's wgrad roles only
            deq = out.dequantized.contiguous().clone()
            deq.view(torch.int32).view(-1)[5] ^= 1
            out = out._replace(dequantized=deq)
        return out

    monkeypatch.setattr(check, "quantize", off_by_one_bit)
    _, diffs = check.check(torch.device("cpu"), log=lambda line: None)
    assert diffs and all(d.startswith("DIFF nvfp4") and " fused values" in d and "wgrad_" in d for d in diffs)
    # nvfp4 and nvfp4_nearest, 2 wgrad roles, the 2 finite probes (with an Inf, NVFP4 dequantizes
    # the whole tensor to NaN, and a flipped NaN bit is still NaN)
    assert len(diffs) == 2 * 2 * 2
