import sys

import torch

from snip_megatron.emulation import QuantRuntime, quantized_linear
from snip_megatron.formats import FormatSpec


def test_parts_are_timed_while_measuring_and_the_functions_restored_after(emulation_profile):
    linear = sys.modules["snip_megatron.emulation.quantized_linear"]
    before = (linear.quantize_for_role, linear._shard_noise, linear._gemm)
    timer = emulation_profile.PartTimer()
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(48, 64, requires_grad=True)
    runtime = QuantRuntime(generator=torch.Generator().manual_seed(0))
    with emulation_profile.instrumented(timer):
        quantized_linear(x, w, None, FormatSpec.for_precision("fp4"), runtime).sum().backward()
        assert not timer.calls  # not measuring yet
        with timer.measuring():
            quantized_linear(x, w, None, FormatSpec.for_precision("fp4"), runtime).sum().backward()
    # NVFP4: W's fprop quantization serves dgrad, so five casts; SR noise for both G_Y casts
    assert dict(timer.calls) == {"quantize": 5, "gemm": 3, "noise": 2}
    assert all(s > 0 for s in timer.seconds.values())
    assert (linear.quantize_for_role, linear._shard_noise, linear._gemm) == before


def test_cast_ops_counts_each_quantized_role(emulation_profile):
    rows = emulation_profile.cast_ops(FormatSpec.for_precision("fp8"), (64, 128), repeats=2)
    assert len(rows) == 6
    assert all(ops > 5 and us > 0 and copy_us > 0 for _, ops, us, copy_us in rows)


def test_the_profile_prints_its_table_and_result_line(emulation_profile, tmp_path, capsys):
    emulation_profile.main(["--num-layers", "1", "--vocab-size", "512", "--seq-length", "32",
                            "--micro-batch-size", "2", "--rounds", "1", "--steps-per-round", "1",
                            "--max-bytes", "100000", "--data-cache", str(tmp_path)])
    out = capsys.readouterr().out
    assert "fp4 casts of a [64, 128] BF16 operand" in out
    result = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split()[1:])
    assert set(result) == {"fp8_vs_bf16", "fp4_vs_bf16", "quantize_share_fp4", "ops_per_cast_fp4", "us_per_op_fp4"}
    assert 0 < float(result["quantize_share_fp4"]) < 1
