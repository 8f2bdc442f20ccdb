"""Quantized operands as a tensor-core GEMM reads them (formats/operand.py): for every recipe variant
and role, the BF16 values are exactly the reference's element values times the scales BF16 holds
(bit for bit, from the reference's own codes and scales), the FP32 scales kept apart are the
reference's bit for bit, and putting them back gives the reference's dequantized tensor to within
one rounding (exactly where no FP32 scale was factored out)."""

import pytest
import torch

from snip_megatron.formats import Role, hadamard_last_dim, quantize_reference
from snip_megatron.formats.constants import E2M1_VALUES, E8M0_BIAS
from snip_megatron.formats.operand import quantize_operand
from snip_megatron.formats.spec import ElementFormat, ScaleFormat
from snip_megatron.formats.sr_noise import CounterNoise
from tests.formats.test_fused import SPECS


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(11)
    # 200 x 272: no whole 128 or 32 blocks; magnitudes over 6 decades; a zero block; ties of E2M1
    x = torch.randn(200, 272, generator=g) * torch.logspace(-3, 3, 272)
    x[3, :128] = 0.0
    x[4, :16] = torch.tensor([0.25, 0.75, 2.5, 5.0] * 4) * 1e-2
    return x.to(dtype)


def _element_values(codes: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    if element is ElementFormat.E2M1:
        magnitude = torch.tensor(E2M1_VALUES)[(codes & 7).long()]
        return torch.where((codes & 8) > 0, -magnitude, magnitude)
    return codes.float()


def _kept_scale(ref, cast) -> "torch.Tensor | None":
    """The block scale the BF16 operand keeps (powers of two, E4M3), per block; None: none."""
    if cast.block is None or cast.scale is ScaleFormat.FP32:
        return None
    if cast.scale is ScaleFormat.E8M0:
        return torch.exp2(ref.scales.float() - E8M0_BIAS)
    return ref.scales.float()  # pow2 (FP32 powers of two) or E4M3 (NVFP4)


def _per_element(scales: torch.Tensor, block, shape) -> torch.Tensor:
    br, bc = block
    return scales.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:shape[0], :shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_operand_values_are_the_reference_quantization_exactly(name, dtype):
    spec = SPECS[name]
    x = _data(dtype)
    for role in Role:
        cast, dim = spec.cast(role), role.contraction_dim
        noise = CounterNoise(0x1234567890ABCDEF)
        ref = quantize_reference(x, cast, dim=dim, noise=noise, out_dtype=torch.float32, return_codes=True)
        op = quantize_operand(x, cast, dim=dim, noise=noise)
        assert op.values.dtype == torch.bfloat16, (name, role)
        expected = _element_values(ref.codes, cast.element)  # GEMM layout, whole blocks
        kept = _kept_scale(ref, cast)
        if kept is not None:
            expected = expected * _per_element(kept, cast.block, expected.shape)  # exact in FP32
        expected = expected if cast.hadamard else expected[:op.values.shape[0], :op.values.shape[1]]
        assert op.values.shape == expected.shape, (name, role)
        assert torch.equal(op.values.float(), expected), (name, role)

        # the FP32 scales the GEMM applies: the reference's, bit for bit
        if cast.block is not None and cast.scale is ScaleFormat.FP32:
            assert op.block == cast.block and torch.equal(op.block_scales, ref.scales), (name, role)
        else:
            assert op.block_scales is None, (name, role)
        tensor_scale = ref.tensor_scale if cast.tensor_scale else (ref.scales if cast.block is None else None)
        if tensor_scale is None:
            assert op.tensor_scale is None, (name, role)
        else:
            assert torch.equal(op.tensor_scale, tensor_scale.reshape(())), (name, role)

        # and back: the reference's dequantized operand, within one rounding of the scale product
        full = op.values.float()
        if op.block_scales is not None:
            full = full * _per_element(op.block_scales, op.block, full.shape)
        if op.tensor_scale is not None:
            full = full * op.tensor_scale
        deq = ref.dequantized if dim == -1 else ref.dequantized.t()
        if cast.hadamard:  # the operand stays in the transformed domain
            full = hadamard_last_dim(full, cast.hadamard, inverse=True)[:, :deq.shape[1]]
            tol = 1e-6 * deq.abs().max()
        else:
            tol = 2.0**-23 * deq.abs()
            if op.tensor_scale is None and op.block_scales is None:
                tol = torch.zeros_like(deq)  # nothing factored out: the same numbers
        assert ((full - deq).abs() <= tol).all(), (name, role)


@pytest.mark.parametrize("name", ["blockwise", "tensorwise", "nvfp4", "mxfp8"])
def test_non_finite_groups_stay_nan(name):
    spec = SPECS[name]
    x = _data()
    x[7, 9] = float("nan")
    x[150, 200] = float("inf")
    for role in (Role.FPROP_INPUT, Role.WGRAD_INPUT):
        cast, dim = spec.cast(role), role.contraction_dim
        op = quantize_operand(x, cast, dim=dim, noise=CounterNoise(3))
        ref = quantize_reference(x, cast, dim=dim, noise=CounterNoise(3), out_dtype=torch.float32)
        ref = ref if dim == -1 else ref.t()
        full = op.values.float()
        if op.block_scales is not None:
            full = full * _per_element(op.block_scales, op.block, full.shape)
        if cast.hadamard:
            full = hadamard_last_dim(full, cast.hadamard, inverse=True)[:, :ref.shape[1]]
        assert torch.equal(torch.isnan(full), torch.isnan(ref)), (name, role)


def test_transposed_operand_is_the_other_roles_quantization():
    # A weight cast with square tiles serves fprop and dgrad: .t() of the fprop operand is dgrad's.
    w = _data()
    for name in ("blockwise", "nvfp4", "tensorwise"):
        spec = SPECS[name]
        fprop = quantize_operand(w, spec.cast(Role.FPROP_WEIGHT), dim=-1).t()
        dgrad = quantize_operand(w, spec.cast(Role.DGRAD_WEIGHT), dim=0)
        assert torch.equal(fprop.values, dgrad.values) and fprop.block == dgrad.block, name
        for a, b in ((fprop.block_scales, dgrad.block_scales), (fprop.tensor_scale, dgrad.tensor_scale)):
            assert (a is None and b is None) or torch.equal(a, b), name


def test_operand_needs_a_cast():
    with pytest.raises(ValueError, match="CastConfig"):
        quantize_operand(torch.ones(4, 16), None)
