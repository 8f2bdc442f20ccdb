"""TE 2.14's quantize kernels, computed on the CPU: what one TE quantizer writes for one usage of
a tensor, and the values TE's GEMM multiplies.

The double's own arithmetic, written from TE's source rule by rule (each rule cites the TE v2.14
file and lines it follows; paths under transformer_engine/), with torch's float8 casts for FP8
elements and torchao's E2M1 cast for FP4 elements (`_e2m1_nearest`; TE's reference cast where
torchao is not installed). It imports nothing from snip_megatron: tests hold SNIP's emulation to
it, not the other way round.

A tensor is quantized for one usage (TE's quantizers make both at once; the double makes each
when a GEMM reads it):

    row-wise      the tensor as 2D (leading dims flattened) x last dim, blocks along the last dim
                  (fprop's X and W, dgrad's G_Y)
    column-wise   its transpose, blocks along the flattened leading dims (wgrad's X and G_Y,
                  dgrad's W); NVFP4 applies the random Hadamard transform (RHT) here only

Every result is in the GEMM layout (rows x K, the contracted dim last). `Quantized.values` are
the FP32 values TE's dequantize kernels give back; the double's GEMM (`_gemm.py`) multiplies them
in FP32.

Deliberate differences from TE (tests that compare the double with SNIP allow for the last two):
- TE refuses the RHT for anything but BF16 input (csrc/quantizer.cpp:2283-2286 @v2.14); the
  double transforms FP32 too (the CPU tests run FP32 activations) and rounds the result to the
  input's dtype, which for BF16 is TE's rounding (hadamard_transform_cast_fusion.cu:473-478).
- Stochastic rounding takes its uniforms from `stochastic_noise` (torch.rand by default; a test
  process may install another source, see `set_stochastic_noise`): TE's bits come from a Philox
  stream on the GPU (core_nvfp4.cuh:94-107), which no CPU code reproduces.
- The RHT is one FP32 matmul per 16-element chunk (TE's MMA sums in its own order) and the GEMM
  is an FP32 matmul of dequantized operands (cuBLAS applies block scales and NVFP4's alpha inside
  the GEMM, gemm/cublaslt_gemm.cu:360-383, recipe/nvfp4.cu:68-77): a few FP32 ulps apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""Numeric_Traits<fp8e4m3 / fp8e5m2>::maxNorm (common/utils.cuh:954-957, Quantized_Limits)."""
E2M1_MAX = 6.0
"""TypeExtrema<fp4e2m1>::max (cast/nvfp4/core_nvfp4.cuh:81)."""
KINDS = ("float8_current", "float8_block", "mxfp8", "nvfp4")


@dataclass(frozen=True)
class TEQuantizer:
    """One TE quantizer's settings, as far as they decide its numbers. `kind`:
    float8_current (Float8CurrentScalingQuantizer), float8_block (Float8BlockQuantizer), mxfp8
    (MXFP8Quantizer), nvfp4 (NVFP4Quantizer, or the reference NVFP4QuantizerRef of
    custom_recipes)."""

    kind: str
    dtype: torch.dtype = torch.float8_e4m3fn
    """FP8 element dtype (E4M3 or E5M2); nvfp4: torch.uint8 (E2M1 codes, unused here)."""
    block_dim: int = 1
    """float8_block: 1 = 1x128 tiles, 2 = 128x128 blocks; nvfp4: 1 = 1x16, 2 = 16x16."""
    pow2: bool = False
    """force_pow_2_scales (FP8 kinds)."""
    amax_epsilon: float = 0.0
    """The floor of an amax (FP8 kinds)."""
    rht: bool = False
    """nvfp4: random Hadamard transform of the column-wise copy (with its post-RHT amax)."""
    stochastic: bool = False
    """nvfp4: stochastic rounding of the E2M1 elements."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TEQuantizer kind {self.kind!r}: one of {', '.join(KINDS)}")

    @property
    def tile(self) -> Optional[tuple[int, int]]:
        """(rows, cols) of one scaling block in the GEMM layout; None: one scale per tensor."""
        if self.kind == "float8_current":
            return None
        if self.kind == "mxfp8":
            return (1, 32)
        size = 128 if self.kind == "float8_block" else 16
        return (size, size) if self.block_dim == 2 else (1, size)

    def short_str(self) -> str:
        """E.g. "float8_block e4m3 1x128 pow2", "nvfp4 e2m1 1x16 rht sr"."""
        element = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(self.dtype, "e2m1")
        parts = [self.kind, "e2m1" if self.kind == "nvfp4" else element,
                 "tensor" if self.tile is None else f"{self.tile[0]}x{self.tile[1]}"]
        if self.kind.startswith("float8"):
            parts.append("pow2" if self.pow2 else "fp32")
        if self.amax_epsilon:
            parts.append(f"eps={self.amax_epsilon:g}")
        if self.rht:
            parts.append("rht")
        if self.kind == "nvfp4":
            parts.append("sr" if self.stochastic else "rne")
        return " ".join(parts)


class Quantized(NamedTuple):
    """One usage of a quantized tensor, in the GEMM layout (rows x K)."""

    values: torch.Tensor
    """FP32: what TE's dequantize gives back (the elements times their scales)."""
    elements: torch.Tensor
    """FP32: the element values (E4M3 / E5M2 / E2M1 grid values) before their scales."""
    scale_inv: torch.Tensor
    """FP32 decode scale per block, (rows / tile rows, K / tile cols); 1x1 per tensor."""
    amax: Optional[torch.Tensor]
    """nvfp4: the FP32 per-tensor amax its scales are relative to; else None."""


# ---------------------------------------------------------------------------------------------
# stochastic rounding's uniforms

def _torch_uniform(generator: Optional[torch.Generator], shape) -> torch.Tensor:
    return torch.rand(shape, generator=generator, dtype=torch.float32)


_NOISE: list[Callable] = [_torch_uniform]


def set_stochastic_noise(source: Optional[Callable] = None) -> None:
    """Where stochastic rounding's U[0, 1) draws come from: `source(generator, shape)`, called
    once per quantized copy with the module's generator and the tensor's natural 2D shape
    (None: torch.rand). TE draws Philox bits on the GPU; a test process that compares the double
    with another emulation installs that emulation's draws here, so that the rounding rule and
    where it applies are compared bit for bit."""
    _NOISE[0] = _torch_uniform if source is None else source


def stochastic_noise(generator: Optional[torch.Generator], shape) -> torch.Tensor:
    return _NOISE[0](generator, tuple(shape)).float()


# ---------------------------------------------------------------------------------------------
# scales

def compute_scale_from_amax(amax: torch.Tensor, fp8_max: float, pow2: bool, epsilon: float,
                            value_for_inf: float) -> torch.Tensor:
    """common/recipe/recipe_common.cuh:14-49 (`compute_scale_from_amax`), elementwise on FP32:
    amax floored at epsilon; 1 for a zero, infinite or NaN amax; max / amax (correctly rounded,
    __fdiv_rn) capped at `value_for_inf`; force_pow_2_scales keeps its sign and exponent bits
    (& 0xFF800000)."""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)  # NaN < eps is False
    scale = torch.tensor(fp8_max, dtype=torch.float32) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    special = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    scale = torch.where(special, torch.ones_like(scale), scale)
    if pow2:
        scale = (scale.contiguous().view(torch.int32) & -(1 << 23)).view(torch.float32)  # 0xFF800000
    return scale


def _reciprocal_via_double(x: torch.Tensor) -> torch.Tensor:
    """`1.0 / x` with x a float and 1.0 a double literal, assigned to a float: the division in
    double, then rounded to float (e.g. transpose/quantize_transpose_vector_blockwise.cu:302)."""
    return (1.0 / x.double()).float()


def float_to_e8m0(value: torch.Tensor) -> torch.Tensor:
    """util/ptx.cuh:368-398 (`float_to_e8m0`, the software twin of cvt.rp.satfinite.ue8m0x2.f32):
    the biased exponent of the smallest power of two >= value (NaN: 255, inf: 254, 0: 0), from
    the float's bits: one up whenever the mantissa is nonzero, except at exponent 254 (saturate)
    and for subnormals at or below 2**-127."""
    bits = value.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    out = exponent + up.to(torch.int32)
    out = torch.where(torch.isinf(value), torch.full_like(out, 0xFE), out)
    out = torch.where(torch.isnan(value), torch.full_like(out, 0xFF), out)
    return torch.where(value == 0, torch.zeros_like(out), out)


def exp2f_rcp(biased: torch.Tensor) -> torch.Tensor:
    """util/ptx.cuh:338-346 (`exp2f_rcp<float>`): 2**(127 - e) from the exponent bits; NaN for
    255; 2**-127 (0x00400000) for 254. Code 0 gives 2**127 ((254 - 0) << 23)."""
    biased = biased.to(torch.int32)
    out = ((254 - biased).clamp(min=0) << 23).view(torch.float32)
    out = torch.where(biased == 254, torch.full_like(out, 2.0**-127), out)
    return torch.where(biased == 255, torch.full_like(out, float("nan")), out)


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """cast/nvfp4/core_nvfp4.cuh:79-91 (`compute_global_encode_scaling_factor_FP4`):
    448 * 6 / amax capped at the largest float; 1 for a zero amax or a zero scale (an infinite
    amax)."""
    amax = amax.float()
    scale = torch.tensor(448.0 * 6.0, dtype=torch.float32) / amax
    scale = torch.minimum(scale, torch.tensor(FLOAT32_MAX))
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


# ---------------------------------------------------------------------------------------------
# element casts

def cast_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """static_cast<fp8e4m3 / fp8e5m2>(float): __nv_fp8_e4m3 / __nv_fp8_e5m2 (common/common.h:507-508)
    convert with __NV_SATFINITE and round to nearest even: finite overflow saturates, NaN stays
    NaN. torch's cast rounds to nearest even but does not saturate, so clamp first."""
    m = FP8_MAX[dtype]
    return y.clamp(-m, m).to(dtype).float()


@functools.lru_cache(maxsize=None)
def _torchao_e2m1():
    try:
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
    except Exception:  # torchao absent (the Bridge venv): TE's reference cast below
        return None
    return f32_to_f4_unpacked, f4_unpacked_to_f32


# custom_recipes/quantization_nvfp4.py:50-72 (`cast_to_fp4x2`): its decision boundaries for
# |x|: (upper bound of the interval, whether it is closed, value); ties go to the even code.
_REFERENCE_E2M1 = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
                   (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))


def _e2m1_reference(a: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(a, E2M1_MAX)
    for bound, closed, value in reversed(_REFERENCE_E2M1):
        out = torch.where(a <= bound if closed else a < bound, torch.full_like(a, value), out)
    return out


def _e2m1_nearest(y: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e2m1x2.f32 (util/ptx.cuh:741-742): round to the nearest E2M1 value, ties
    to even, saturating at 6; through torchao's f32_to_f4_unpacked / f4_unpacked_to_f32 (TE's
    reference thresholds when torchao is absent). NaN is kept NaN (E2M1 has none; the GEMM
    would see garbage either way)."""
    a = y.abs().clamp(max=E2M1_MAX)
    torchao = _torchao_e2m1()
    q = _e2m1_reference(a) if torchao is None else torchao[1](torchao[0](a.contiguous()))
    q = torch.where(torch.isnan(y), y, q)
    return q.copysign(y)


def _e2m1_stochastic(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """cvt.rs.satfinite.e2m1x4.f32 (util/ptx.cuh:683-708): saturate at 6, then round |y| to one of
    its two E2M1 neighbours lo <= |y| < lo + step, up when the random bits added below the kept
    precision carry over, i.e. when frac + u >= 1 with frac = (|y| - lo) / step: up with
    probability frac. Computed in float64, where |y| / step + u is exact (u on a 2**-24 grid)."""
    a = y.abs().clamp(max=E2M1_MAX).double()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(torch.float64)
    q = (torch.floor(a / step + u.double()) * step).clamp(max=E2M1_MAX).float()
    q = torch.where(torch.isnan(y), y, q)
    return q.copysign(y)


# ---------------------------------------------------------------------------------------------
# the random Hadamard transform

def wgrad_sign_vector() -> torch.Tensor:
    """pytorch/tensor/nvfp4_tensor.py:49-60 (`get_wgrad_sign_vector`): TE's hard-coded signs (the
    same vector as custom_recipes/quantization_nvfp4.py:334-339)."""
    return torch.tensor([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def rht_matrix() -> torch.Tensor:
    """pytorch/tensor/nvfp4_tensor.py:63-104 (`get_hadamard_matrix`, `get_rht_matrix`):
    diag(signs) @ H16 / 4 (stored in BF16, where +-1/4 is exact)."""
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (torch.diag(wgrad_sign_vector()) @ h * 0.25).to(torch.bfloat16)


def random_hadamard_transform(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The column-wise copy's RHT along its last dim (the tokens), 16 at a time: x_chunk @ M
    (custom_recipes/quantization_nvfp4.py:397-420, `_apply_rht`), FP32 accumulation, then rounded
    to the input's dtype: TE's RHT kernels write / downcast BF16 (hadamard/
    hadamard_transform_cast_fusion.cu:473-478 "for bit-wise compatibility with unfused kernels";
    its amax, hadamard_transform.cu:52, is taken of those BF16 values)."""
    rows, cols = x.shape
    if cols % 16:
        raise ValueError(f"Inner dimension {cols} must be divisible by hadamard dimension 16")
    out = torch.matmul(x.reshape(-1, 16), rht_matrix().float()).reshape(rows, cols)
    return out.to(dtype).float()


# ---------------------------------------------------------------------------------------------
# quantize

def quantize(tensor: torch.Tensor, quantizer: TEQuantizer, *, columnwise: bool,
             generator: Optional[torch.Generator] = None) -> Quantized:
    """`tensor` quantized by `quantizer` for one usage (module docstring), in the GEMM layout.
    `generator`: the module's, for stochastic rounding's uniforms (`stochastic_noise`)."""
    x = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() != 1 else tensor.reshape(1, -1)
    noise = None
    if quantizer.kind == "nvfp4" and quantizer.stochastic:
        noise = stochastic_noise(generator, x.shape)  # one draw per quantized copy
        noise = noise.t() if columnwise else noise
    x = x.float()
    if columnwise:
        x = x.t()
    x = x.contiguous()
    if quantizer.kind == "float8_current":
        return _float8_current(x, quantizer)
    if quantizer.kind == "float8_block":
        return _blocked(x, quantizer, _float8_block_tiles, tensor.dtype)
    if quantizer.kind == "mxfp8":
        return _blocked(x, quantizer, _mxfp8_tiles, tensor.dtype)
    if columnwise and quantizer.rht:
        x = random_hadamard_transform(x, tensor.dtype)
    return _nvfp4(x, quantizer, noise, rht_path=columnwise and quantizer.rht)


def _float8_current(x: torch.Tensor, q: TEQuantizer) -> Quantized:
    """Current scaling: the tensor's amax (recipe/current_scaling.cu, nvte_compute_amax), its
    scale (:194-203, value_for_inf = the largest float), the cast of x * scale
    (util/vectorized_pointwise.h:203-206), scale_inv = __frcp_rn(scale) (:222-224, utils.cuh:919-921);
    dequantize: x * scale_inv (cast/fp8/dequantize_fp8.cuh:32)."""
    amax = x.abs().amax()
    scale = compute_scale_from_amax(amax, FP8_MAX[q.dtype], q.pow2, q.amax_epsilon, FLOAT32_MAX)
    elements = cast_fp8(x * scale, q.dtype)
    scale_inv = scale.reciprocal()
    return Quantized(elements * scale_inv, elements, scale_inv.reshape(1, 1), None)


def _tiles(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """x zero-padded to whole tiles and viewed (row tiles, tile rows, col tiles, tile cols): TE's
    kernels bound-check partial tiles, so elements past the edge add nothing to a tile's amax."""
    rows, cols = x.shape
    br, bc = tile
    padded = torch.nn.functional.pad(x, (0, -cols % bc, 0, -rows % br))
    return padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc), (rows, cols)


def _blocked(x: torch.Tensor, q: TEQuantizer, rule, input_dtype: torch.dtype) -> Quantized:
    tiles, (rows, cols) = _tiles(x, q.tile)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    elements, scale_inv = rule(tiles, amax, q, input_dtype)
    return Quantized(_untile(elements * scale_inv, rows, cols), _untile(elements, rows, cols),
                     scale_inv.reshape(tiles.shape[0], tiles.shape[2]), None)


def _untile(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `_tiles`: back to (rows, cols), padding cropped."""
    r, br, c, bc = tiles.shape
    return tiles.reshape(r * br, c * bc)[:rows, :cols].contiguous()


def _float8_block_tiles(tiles, amax, q: TEQuantizer, input_dtype):
    """Blockwise FP8 (transpose/quantize_transpose_vector_blockwise.cu:295-314 for 1x128 tiles,
    quantize_transpose_square_blockwise.cu:158-185 for 128x128 blocks): scale =
    compute_scale_from_types (recipe_common.cuh:59-67: value_for_inf = the input dtype's largest
    value), elements = cast(x * scale), scale_inv = 1.0 / scale (:302; square :162);
    dequantize: elements * scale_inv per tile (pytorch/tensor/storage/
    float8_blockwise_tensor_storage.py:206, 275)."""
    value_for_inf = torch.finfo(input_dtype).max if input_dtype.is_floating_point else FLOAT32_MAX
    scale = compute_scale_from_amax(amax, FP8_MAX[q.dtype], q.pow2, q.amax_epsilon, value_for_inf)
    return cast_fp8(tiles * scale, q.dtype), _reciprocal_via_double(scale)


def _mxfp8_tiles(tiles, amax, q: TEQuantizer, input_dtype):
    """MXFP8 (cast/mxfp8/quantize_mxfp8.cuh:268-293): E8M0 exponent = float_to_e8m0(amax *
    max_norm_rcp) with max_norm_rcp = 1.0 / max_norm as a float (utils.cuh:957), elements =
    cast(x * exp2f_rcp(exponent)); dequantize: elements * 2**(exponent - 127)
    (dequantize_mxfp8.cuh:163, 175; cuBLAS reads the E8M0 scale itself)."""
    max_norm_rcp = torch.tensor(1.0 / FP8_MAX[q.dtype], dtype=torch.float32)
    biased = float_to_e8m0(amax * max_norm_rcp)
    elements = cast_fp8(tiles * exp2f_rcp(biased), q.dtype)
    decode = torch.ldexp(torch.ones_like(amax), (biased - 127).to(torch.float32))
    decode = torch.where(biased == 255, torch.full_like(decode, float("nan")), decode)
    return elements, decode


def _nvfp4(x: torch.Tensor, q: TEQuantizer, noise: Optional[torch.Tensor], rht_path: bool) -> Quantized:
    """NVFP4, two-level scales:
    - per tensor: S_enc = nvfp4_global_encode_scale(amax of what is quantized, the post-RHT amax
      for the RHT copy: csrc/quantizer.cpp:2287-2296) and S_dec = 1 / S_enc
      (cast/nvfp4/quantize_transpose_nvfp4.cuh:226-235: in double; the RHT kernel divides in
      float, hadamard_transform_cast_fusion.cu:432-433);
    - per 1x16 tile (or 16x16 block, the weight's 2D quantization; the same block amax for both
      usages, quantize_transpose_nvfp4.cuh:758-887): the E4M3 decode scale
      S_dec_b = e4m3(min(block_amax * (S_enc * (1/6)), FLT_MAX)) (core_nvfp4.cuh:40-52; subnormal
      and zero E4M3 scales are kept), its encode scale
      min(1 / (float(S_dec_b) * S_dec), FLT_MAX) (quantize_transpose_nvfp4.cuh:526-529;
      hadamard_transform_cast_fusion.cu:488-501);
    - elements: x * encode scale rounded to E2M1, to nearest or stochastically
      (quantize_transpose_nvfp4.cuh:533-555);
    - dequantize: elements * (float(S_dec_b) * amax * (1 / (6 * 448)))
      (cast/nvfp4/dequantize_nvfp4.cuh:59-67).
    The reference quantizer of custom_recipes computes the same (quantization_nvfp4.py:442-532,
    "match the kernel's default path")."""
    rows, cols = x.shape
    tiles, _ = _tiles(x, q.tile)
    global_amax = x.abs().amax()
    s_enc = nvfp4_global_encode_scale(global_amax)
    s_dec = (torch.tensor(1.0, dtype=torch.float32) / s_enc) if rht_path else _reciprocal_via_double(s_enc)
    fp4_max_inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(E2M1_MAX, dtype=torch.float32)
    block_amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    s_dec_b = torch.minimum(block_amax * (s_enc * fp4_max_inv), torch.tensor(FLOAT32_MAX))
    s_dec_b = cast_fp8(s_dec_b, torch.float8_e4m3fn)
    encode = torch.minimum(torch.tensor(1.0, dtype=torch.float32) / (s_dec_b * s_dec),
                           torch.tensor(FLOAT32_MAX))
    scaled = tiles * encode
    if noise is None:
        elements = _e2m1_nearest(scaled)
    else:
        elements = _e2m1_stochastic(scaled, _tiles(noise.contiguous(), q.tile)[0])
    factor_inv = torch.tensor(1.0 / (6.0 * 448.0), dtype=torch.float32)
    decode = s_dec_b * global_amax * factor_inv
    return Quantized(_untile(elements * decode, rows, cols), _untile(elements, rows, cols),
                     s_dec_b.reshape(tiles.shape[0], tiles.shape[2]), global_amax.reshape(1))
