"""A weight's error by blocks of rows equals the error of the whole tensor, bit for bit, for every
format, also with per-tensor scales (the sentinel block) and non-finite values."""

import math

import pytest
import torch

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.stats.quant_error import formats_error_fn
from snip_megatron.stats.weights import block_rows, error_blocks

ROLES = ("fprop_weight", "dgrad_weight")


@pytest.mark.parametrize("fp8_recipe,fp4_recipe", [("blockwise", "nvfp4"), ("tensorwise", "mxfp4"),
                                                   ("mxfp8", "nvfp4")])
@pytest.mark.parametrize("rows", [300, 256])  # a partial last block, and whole blocks
def test_blocks_equal_the_whole_tensor(fp8_recipe, fp4_recipe, rows):
    w = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 0.02
    w[7, 3] = 0.5  # one large element: the per-tensor amax lives in one block only
    err = formats_error_fn(Formats(fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe))
    for p in (Precision.FP8, Precision.FP4):
        whole = {r: err(w, p, r) for r in ROLES}
        got = {r: torch.empty_like(w) for r in ROLES}
        blocks = list(error_blocks(w, err, {p: ROLES}, rows=128))
        assert len(blocks) == math.ceil(rows / 128)
        for sl, w_blk, errs in blocks:
            assert torch.equal(w_blk, w[sl])
            for r in ROLES:
                got[r][sl] = errs[p][r]
        for r in ROLES:
            assert torch.equal(got[r], whole[r]), (p, r)


def test_nonfinite_weights_stay_nonfinite_like_the_whole_tensor():
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    w[200, 5] = math.nan
    err = formats_error_fn(Formats(fp4_recipe="nvfp4"))
    for p in (Precision.FP8, Precision.FP4):
        whole = err(w, p, "fprop_weight")
        got = torch.cat([e[p]["fprop_weight"] for _, _, e in error_blocks(w, err, {p: ("fprop_weight",)}, rows=128)])
        assert torch.equal(torch.isnan(got), torch.isnan(whole)), p
        assert torch.equal(got.nan_to_num(), whole.nan_to_num())
    # NVFP4's per-tensor scale makes the whole tensor NaN; FP8 blockwise only the NaN's 128x128 block
    assert torch.isnan(got).all()


def test_block_rows():
    assert block_rows(1000, 100) == 1000  # small: one block
    r = block_rows(7168, 8192)  # a 70B fc1 shard at TP=8
    assert r % 128 == 0 and r * 8192 <= 1 << 22 and r >= 128
    with pytest.raises(ValueError, match="multiple of 128"):
        list(error_blocks(torch.zeros(512, 8), formats_error_fn(), {Precision.FP8: ROLES}, rows=100))
