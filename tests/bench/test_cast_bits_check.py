"""bench/gpu/cast_bits_check.py on CPU: the fused path equals the reference on every recipe, role and
probe (what it checks on a GPU), and a single differing bit is reported with where it is."""

import torch


def test_every_cast_agrees_on_cpu(cast_bits_check):
    n, diffs = cast_bits_check.check(torch.device("cpu"), log=lambda line: None)
    # 3 noise checks; per variant and role: on each of the 2 finite probes 2 paths x (values, codes,
    # scales, tensor scale) and 3 operand checks, on the special probe 2 x values and 3 operand checks
    assert n == 3 + len(cast_bits_check.VARIANTS) * 6 * (2 * (2 * 4 + 3) + (2 * 1 + 3)) == 1299
    assert diffs == []


def test_a_flipped_bit_is_reported(cast_bits_check, monkeypatch):
    real = cast_bits_check.quantize

    def off_by_one_bit(x, cast, **kw):
        out = real(x, cast, **kw)
        if cast.element.value == "e2m1" and cast.hadamard:  # NVFP4's wgrad roles only
            deq = out.dequantized.contiguous().clone()
            deq.view(torch.int32).view(-1)[5] ^= 1
            out = out._replace(dequantized=deq)
        return out

    monkeypatch.setattr(cast_bits_check, "quantize", off_by_one_bit)
    _, diffs = cast_bits_check.check(torch.device("cpu"), log=lambda line: None)
    assert diffs and all(d.startswith("DIFF nvfp4") and " fused values" in d and "wgrad_" in d for d in diffs)
    # nvfp4 and nvfp4_nearest, 2 wgrad roles, the 2 finite probes (with an Inf, NVFP4 dequantizes
    # the whole tensor to NaN, and a flipped NaN bit is still NaN)
    assert len(diffs) == 2 * 2 * 2
