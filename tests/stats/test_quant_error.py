"""The collector's error function: E = Q(T) - T by role, and a weight's dgrad error reused only
where it equals the fprop one."""

import torch

from snip_megatron import formats
from snip_megatron.formats.precision import Precision
from snip_megatron.formats.spec import FormatSpec, Role
from snip_megatron.formats.precision import Formats
from snip_megatron.stats.quant_error import formats_error_fn

FP8, FP4 = Precision.FP8, Precision.FP4


def _direct(t, p, role, fp4_recipe):
    spec = FormatSpec.for_precision(p, fp8_recipe="blockwise", fp4_recipe=fp4_recipe)
    return formats.quantize_for_role(t, spec, Role(role), out_dtype=torch.float32) - t


def test_square_block_weights_share_the_fprop_error():
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    for p in (FP8, FP4):  # blockwise FP8: 128x128 weight blocks; NVFP4: 16x16 weight tiles
        err = formats_error_fn(Formats(fp4_recipe="nvfp4"))
        e_fprop = err(w, p, "fprop_weight")
        e_dgrad = err(w, p, "dgrad_weight")
        assert e_dgrad is e_fprop  # not recomputed
        torch.testing.assert_close(e_dgrad, _direct(w, p, "dgrad_weight", "nvfp4"), rtol=0, atol=0)
        assert float(e_fprop.abs().sum()) > 0


def test_no_reuse_across_tensors_layouts_or_changes():
    g = torch.Generator().manual_seed(1)
    w, w2 = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    err = formats_error_fn(Formats(fp4_recipe="mxfp4"))
    # MXFP4 weights: 1x32 blocks along the contraction dim, so fprop and dgrad errors differ
    e_fprop, e_dgrad = err(w, FP4, "fprop_weight"), err(w, FP4, "dgrad_weight")
    assert not torch.equal(e_fprop, e_dgrad)
    torch.testing.assert_close(e_dgrad, _direct(w, FP4, "dgrad_weight", "mxfp4"), rtol=0, atol=0)
    err = formats_error_fn(Formats(fp4_recipe="nvfp4"))
    e1 = err(w, FP4, "fprop_weight")
    torch.testing.assert_close(err(w2, FP4, "dgrad_weight"), _direct(w2, FP4, "dgrad_weight", "nvfp4"),
                               rtol=0, atol=0)  # another tensor: its own error
    err(w, FP4, "fprop_weight")
    w.mul_(2.0)  # changed in place: recomputed
    torch.testing.assert_close(err(w, FP4, "dgrad_weight"), _direct(w, FP4, "dgrad_weight", "nvfp4"),
                               rtol=0, atol=0)
    assert not torch.equal(e1, err(w, FP4, "dgrad_weight"))


def test_a_column_shard_rounds_with_the_whole_tensors_noise():
    # NVFP4 G_Y roles round stochastically. Every column chunk holds the same values, so each
    # shard's per-tensor amax is the whole tensor's (no group needed) and only the noise tells the
    # columns apart: a strided shard's error is the whole tensor's error at its columns.
    from snip_megatron.stats.noise import shard_indices

    chunk = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    g = chunk.repeat(1, 4)  # 4 chunks: TP=2 with partition stride 2
    for role in ("dgrad_grad_output", "wgrad_grad_output"):
        whole = formats_error_fn(Formats())(g, FP4, role)
        for rank in range(2):
            cols = shard_indices(64, rank, 2, 2)
            local = formats_error_fn(Formats())(g[:, cols], FP4, role, shard=(rank, 2, 2))
            torch.testing.assert_close(local, whole[:, cols], rtol=0, atol=0)
        unsharded = formats_error_fn(Formats())(g[:, shard_indices(64, 1, 2, 2)], FP4, role)
        assert not torch.equal(unsharded, whole[:, shard_indices(64, 1, 2, 2)])  # the noise matters
