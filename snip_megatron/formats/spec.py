"""What each GEMM operand of a linear layer is quantized to, per precision and named recipe.

A linear layer Y = X W^T (X: n x k tokens x in-features, W: m x k) runs three GEMMs:

    fprop:  Y   = X   @ W^T     contracts k (in-features)
    dgrad:  G_X = G_Y @ W       contracts m (out-features)
    wgrad:  G_W = G_Y^T @ X     contracts n (tokens)

Each of the six operands (a `Role`) gets one `CastConfig`. Block shapes are written in the layout
the GEMM consumes, with the contraction dimension last: "1x16" means 16 consecutive elements along
the contracted dimension, "16x16" a square tile (the same tile whichever way the weight is used).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

from snip_megatron.formats.constants import E2M1_MAX, E4M3_MAX, E5M2_MAX
from snip_megatron.formats.recipes import (
    FP4_RECIPES, FP8_RECIPES, Precision, check_variants, effective_fp4_gradient_rounding, effective_fp8_format,
)


class Role(str, Enum):
    """The six GEMM operands of a linear layer: "<gemm>_<operand>"."""

    FPROP_INPUT = "fprop_input"
    FPROP_WEIGHT = "fprop_weight"
    DGRAD_GRAD_OUTPUT = "dgrad_grad_output"
    DGRAD_WEIGHT = "dgrad_weight"
    WGRAD_GRAD_OUTPUT = "wgrad_grad_output"
    WGRAD_INPUT = "wgrad_input"

    @property
    def gemm(self) -> str:
        return self.value.split("_", 1)[0]

    @property
    def operand(self) -> str:
        """"input", "weight" or "grad_output": which tensor of the layer this role reads."""
        return self.value.split("_", 1)[1]

    @property
    def contraction_dim(self) -> int:
        """The dimension of the operand, in its natural 2D layout (X: n x k, W: m x k,
        G_Y: n x m), that this GEMM contracts; quantization blocks run along it."""
        return -1 if self in (Role.FPROP_INPUT, Role.FPROP_WEIGHT, Role.DGRAD_GRAD_OUTPUT) else 0

    def __str__(self) -> str:
        return self.value


# The two operands of each GEMM, which must agree on blocking and scale format.
GEMM_OPERANDS = {
    "fprop": (Role.FPROP_INPUT, Role.FPROP_WEIGHT),
    "dgrad": (Role.DGRAD_GRAD_OUTPUT, Role.DGRAD_WEIGHT),
    "wgrad": (Role.WGRAD_GRAD_OUTPUT, Role.WGRAD_INPUT),
}


class ElementFormat(str, Enum):
    """Element (value) format."""

    E4M3 = "e4m3"  # FP8, max 448, torch.float8_e4m3fn
    E5M2 = "e5m2"  # FP8, max 57344, torch.float8_e5m2
    E2M1 = "e2m1"  # FP4, {0, .5, 1, 1.5, 2, 3, 4, 6}

    @property
    def max(self) -> float:
        return {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX, "e2m1": E2M1_MAX}[self.value]


class ScaleFormat(str, Enum):
    """Format of the per-block (or per-tensor) scale."""

    FP32 = "fp32"  # any float32 (FP8 blockwise / tensorwise)
    POW2 = "pow2"  # a float32 power of two: max / amax rounded down (TE's force_pow_2_scales)
    E4M3 = "e4m3"  # FP8 E4M3 block scale (NVFP4; always with an FP32 per-tensor scale)
    E8M0 = "e8m0"  # power of two, rounded up (MX formats, RCEIL)


class Rounding(str, Enum):
    NEAREST_EVEN = "rne"
    STOCHASTIC = "sr"  # unbiased; random bits from a dedicated, seeded torch.Generator


@dataclass(frozen=True, kw_only=True)
class CastConfig:
    """How one GEMM operand is quantized."""

    element: ElementFormat
    """Element format."""
    block: tuple[int, int] | None
    """(rows, cols) of one scaling block in the GEMM layout (contraction dim last); None = one
    scale for the whole tensor (with tensor parallelism: the whole unsharded tensor)."""
    scale: ScaleFormat = ScaleFormat.FP32
    """Format of the block scale."""
    tensor_scale: bool = False
    """Second-level FP32 per-tensor scale under the block scales (NVFP4)."""
    rounding: Rounding = Rounding.NEAREST_EVEN
    """Element rounding."""
    hadamard: int = 0
    """Size of the random Hadamard transform applied along the contraction dimension before
    quantizing (0 = none). Both operands of a GEMM must use the same size, so it cancels."""

    def __post_init__(self) -> None:
        if not isinstance(self.element, ElementFormat):
            raise ValueError(f"CastConfig.element must be an ElementFormat, got {self.element!r}")
        if self.block is not None:
            ok = (isinstance(self.block, tuple) and len(self.block) == 2
                  and all(isinstance(b, int) and b > 0 for b in self.block))
            if not ok:
                raise ValueError(f"CastConfig.block must be None or (rows, cols) of positive ints, "
                                 f"got {self.block!r}")
        if self.block is None and self.scale is not ScaleFormat.FP32:
            raise ValueError(f"CastConfig.scale={self.scale.value} needs a block shape; "
                             "per-tensor scales are fp32")
        if self.scale is ScaleFormat.POW2 and self.element is ElementFormat.E2M1:
            raise ValueError("CastConfig.scale=pow2 is an FP8 block scale (TE Float8BlockScaling); "
                             "E2M1 blocks take e4m3 (NVFP4) or e8m0 (MXFP4) scales")
        if self.scale is ScaleFormat.E4M3 and not self.tensor_scale:
            raise ValueError("CastConfig.scale=e4m3 needs tensor_scale=True (NVFP4 two-level scaling)")
        if self.tensor_scale and self.scale is not ScaleFormat.E4M3:
            raise ValueError(f"CastConfig.tensor_scale=True is only defined for e4m3 block scales, "
                             f"got scale={self.scale.value}")
        if self.rounding is Rounding.STOCHASTIC and self.element is not ElementFormat.E2M1:
            raise ValueError(f"CastConfig.rounding=sr is implemented for e2m1 only, "
                             f"got element={self.element.value}")
        if self.hadamard:
            if self.block is None or self.block[1] % self.hadamard:
                raise ValueError(f"CastConfig.hadamard={self.hadamard} must divide the block length "
                                 f"along the contraction dim, block={self.block}")
            if self.hadamard & (self.hadamard - 1):
                raise ValueError(f"CastConfig.hadamard={self.hadamard} must be a power of two")

    @property
    def block_k(self) -> int | None:
        """Block length along the contraction dimension (None: per-tensor)."""
        return None if self.block is None else self.block[1]

    def short_str(self) -> str:
        """E.g. "e2m1 1x16 e4m3*fp32 sr h16"."""
        block = "tensor" if self.block is None else f"{self.block[0]}x{self.block[1]}"
        scale = self.scale.value + ("*fp32" if self.tensor_scale else "")
        parts = [self.element.value, block, scale]
        if self.rounding is Rounding.STOCHASTIC:
            parts.append("sr")
        if self.hadamard:
            parts.append(f"h{self.hadamard}")
        return " ".join(parts)


_ROLE_FIELDS = tuple(r.value for r in Role)


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """The formats of a linear layer's six GEMM operands; None = not quantized (BF16/FP32 GEMM)."""

    precision: Precision
    """The precision this spec realises."""
    recipe: str
    """Recipe name ("bf16", one of FP8_RECIPES or FP4_RECIPES)."""
    fprop_input: CastConfig | None = None
    """X in Y = X W^T."""
    fprop_weight: CastConfig | None = None
    """W in Y = X W^T."""
    dgrad_grad_output: CastConfig | None = None
    """G_Y in G_X = G_Y W."""
    dgrad_weight: CastConfig | None = None
    """W in G_X = G_Y W."""
    wgrad_grad_output: CastConfig | None = None
    """G_Y in G_W = G_Y^T X."""
    wgrad_input: CastConfig | None = None
    """X in G_W = G_Y^T X."""

    def __post_init__(self) -> None:
        # One check that both operands of each GEMM agree (else the GEMM has no hardware meaning
        # and the Hadamard transforms would not cancel).
        for gemm, (ra, rb) in GEMM_OPERANDS.items():
            a, b = self.cast(ra), self.cast(rb)
            if (a is None) != (b is None):
                raise ValueError(f"FormatSpec {self.recipe}: {gemm} quantizes only one operand "
                                 f"({ra.value}={a and a.short_str()}, {rb.value}={b and b.short_str()})")
            if a is None:
                continue
            if a.block_k != b.block_k or a.scale is not b.scale or a.hadamard != b.hadamard:
                raise ValueError(f"FormatSpec {self.recipe}: {gemm} operands disagree on block length "
                                 f"along k, scale format or Hadamard: {ra.value}={a.short_str()!r}, "
                                 f"{rb.value}={b.short_str()!r}")

    def cast(self, role: Role) -> CastConfig | None:
        return getattr(self, Role(role).value)

    @property
    def is_quantized(self) -> bool:
        return any(self.cast(r) is not None for r in Role)

    def short_str(self) -> str:
        """One line for extra_repr: the recipe, then each GEMM's two operand formats."""
        if not self.is_quantized:
            return f"{self.precision.value}"
        gemms = []
        for gemm, (ra, rb) in GEMM_OPERANDS.items():
            gemms.append(f"{gemm}=[{self.cast(ra).short_str()} | {self.cast(rb).short_str()}]")
        return f"{self.precision.value}:{self.recipe} " + " ".join(gemms)

    @classmethod
    def for_precision(cls, precision: "Precision | str", *, fp8_recipe: str = "blockwise",
                      fp4_recipe: str = "nvfp4", fp8_format: "str | None" = None,
                      fp8_block_scales: str = "fp32",
                      fp4_gradient_rounding: "str | None" = None) -> "FormatSpec":
        """The spec of `precision` (the arguments are Formats' fields); the recipe arguments of the
        other precisions are still checked."""
        precision = Precision.parse(precision)
        fp8_recipe = _check_recipe("fp8_recipe", fp8_recipe, FP8_RECIPES)
        fp4_recipe = _check_recipe("fp4_recipe", fp4_recipe, FP4_RECIPES)
        check_variants(fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe, fp8_format=fp8_format,
                       fp8_block_scales=fp8_block_scales, fp4_gradient_rounding=fp4_gradient_rounding)
        if precision is Precision.BF16:
            return cls(precision=precision, recipe="bf16")
        if precision is Precision.FP8:
            casts = _FP8_RECIPES[fp8_recipe](hybrid=effective_fp8_format(fp8_recipe, fp8_format) == "hybrid",
                                             pow2=fp8_block_scales == "pow2")
            return cls(precision=precision, recipe=fp8_recipe, **casts)
        stochastic = effective_fp4_gradient_rounding(fp4_recipe, fp4_gradient_rounding) == "stochastic"
        return cls(precision=precision, recipe=fp4_recipe, **_FP4_RECIPES[fp4_recipe](stochastic=stochastic))


def _check_recipe(field: str, name: str, valid: tuple[str, ...]) -> str:
    key = str(name).strip().lower()
    if key not in valid:
        raise ValueError(f"unknown {field} {name!r}; valid: {', '.join(valid)}")
    return key


def _roles(fwd: CastConfig, weight: CastConfig, grad: CastConfig, *,
           wgrad_grad: CastConfig | None = None, wgrad_input: CastConfig | None = None,
           dgrad_grad: CastConfig | None = None) -> dict[str, CastConfig]:
    """Role map: the input and weight keep their forward cast in the backward GEMMs unless
    overridden (torchao's *_for_grad_* pattern)."""
    return dict(fprop_input=fwd, fprop_weight=weight,
                dgrad_grad_output=dgrad_grad or grad, dgrad_weight=weight,
                wgrad_grad_output=wgrad_grad or grad, wgrad_input=wgrad_input or fwd)


def _fp8_blockwise(*, hybrid: bool, pow2: bool) -> dict:
    # TE Float8BlockScaling / DeepSeek-V3: 1x128 activation and gradient tiles, 128x128 weight
    # blocks (one quantized weight serves fprop and dgrad), FP32 scales; TE's default rounds each
    # scale down to a power of two. HYBRID gives the gradient tiles E5M2 elements.
    scale = ScaleFormat.POW2 if pow2 else ScaleFormat.FP32
    tile = CastConfig(element=ElementFormat.E4M3, block=(1, 128), scale=scale)
    weight = CastConfig(element=ElementFormat.E4M3, block=(128, 128), scale=scale)
    grad = CastConfig(element=ElementFormat.E5M2 if hybrid else ElementFormat.E4M3, block=(1, 128), scale=scale)
    return _roles(tile, weight, grad)


def _fp8_tensorwise(*, hybrid: bool, pow2: bool) -> dict:
    # TE Float8CurrentScaling: one FP32 scale per tensor from this step's amax; HYBRID (TE's
    # default) gives gradients E5M2 for more range, E4M3 keeps E4M3 everywhere.
    fwd = CastConfig(element=ElementFormat.E4M3, block=None)
    grad = CastConfig(element=ElementFormat.E5M2, block=None) if hybrid else fwd
    return _roles(fwd, fwd, grad)


def _mxfp8(*, hybrid: bool, pow2: bool) -> dict:
    # OCP MX: 32 elements share a power-of-two scale, rounded up (RCEIL) so nothing saturates.
    mx = CastConfig(element=ElementFormat.E4M3, block=(1, 32), scale=ScaleFormat.E8M0)
    return _roles(mx, mx, mx)


def _nvfp4(*, stochastic: bool) -> dict:
    # TE NVFP4BlockScaling: E4M3 scale per 16 elements on an FP32 per-tensor scale; 16x16 weight
    # tiles; stochastic rounding on gradients (TE's default; its reference quantizer for other GPUs
    # and NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1 round to nearest); a 16-point random Hadamard on
    # both wgrad operands spreads outliers along the token dimension.
    grad_rounding = Rounding.STOCHASTIC if stochastic else Rounding.NEAREST_EVEN

    def nv(block, rounding=Rounding.NEAREST_EVEN, hadamard=0):
        return CastConfig(element=ElementFormat.E2M1, block=block, scale=ScaleFormat.E4M3,
                          tensor_scale=True, rounding=rounding, hadamard=hadamard)

    return _roles(nv((1, 16)), nv((16, 16)), nv((1, 16), grad_rounding),
                  wgrad_grad=nv((1, 16), grad_rounding, hadamard=16),
                  wgrad_input=nv((1, 16), hadamard=16))


def _mxfp4(*, stochastic: bool) -> dict:
    mx = CastConfig(element=ElementFormat.E2M1, block=(1, 32), scale=ScaleFormat.E8M0)
    return _roles(mx, mx, mx)


_FP8_RECIPES = {"blockwise": _fp8_blockwise, "tensorwise": _fp8_tensorwise, "mxfp8": _mxfp8}
_FP4_RECIPES = {"nvfp4": _nvfp4, "mxfp4": _mxfp4}
assert tuple(_FP8_RECIPES) == FP8_RECIPES and tuple(_FP4_RECIPES) == FP4_RECIPES
assert _ROLE_FIELDS == tuple(f.name for f in fields(FormatSpec))[2:]
