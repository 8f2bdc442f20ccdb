"""What a TE recipe's GEMMs compute (the double's own quantizers, `_quantize.TEQuantizer`), TE's
kernel checks, and TE's rules for switching recipes.

Each recipe maps to the quantizers TE 2.14 builds for a te.Linear's input, weight and grad output
(TE v2.14 `pytorch/quantization.py`, `RecipeState.make_quantizers`; recipe fields from
`common/recipe/__init__.py`), cited entry by entry in `quantizers_of`:

    Float8BlockScaling   -> float8_block: x 1x128, w 128x128, grad 1x128 tiles; E4M3 forward,
                            grad E5M2 under HYBRID; power-of-two or FP32 scales (all alike)
    Float8CurrentScaling -> float8_current: one FP32 scale per tensor; E4M3 forward, grad E5M2
                            under HYBRID
    MXFP8BlockScaling    -> mxfp8: 1x32 E8M0 blocks, E4M3
    NVFP4BlockScaling    -> nvfp4: 1x16 E4M3 scales on an FP32 tensor scale; input and grad RHT
                            on the column-wise copy, 16x16 weight blocks; stochastic grad
                            rounding unless NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1
    CustomRecipe         -> nvfp4 with nearest rounding, when its qfactory hands out exactly TE
                            2.14's reference NVFP4 quantizers
                            (custom_recipes.quantization_nvfp4.nvfp4_ref_rht_2d_quantizer_factory;
                            refused on TE >= 2.16, whose factories take a QuantizerRole)

Refused with NotImplementedError ("not modelled by the test double"): DelayedScaling (amax
history), block dims other than TE's default (1, 2, 1), power-of-two scales on some operands only
or on current scaling, amax epsilons, MXFP8 HYBRID, NVFP4 with its RHT or 2D weights switched
off, any other CustomRecipe. (The double's quantizers could compute several of these; it refuses
them so that every variant it runs is one its tests cover.)

The double's own description, not SNIP's: nothing here imports snip_megatron. Tests compare what
these quantizers compute with SNIP's emulation of the formats SNIP measures.
"""

from __future__ import annotations

import copy

import torch

from transformer_engine.common.recipe import Format, Recipe
from transformer_engine._double import VERSION, version_tuple
from transformer_engine.pytorch._reference_nvfp4 import (NVFP4QuantizerRef,
                                                          nvfp4_ref_rht_2d_quantizer_factory)
from transformer_engine.pytorch.module._gemm import LinearQuantizers
from transformer_engine.pytorch.module._quantize import TEQuantizer
from transformer_engine.pytorch.utils import get_device_compute_capability

FORWARD_ROLES = ("linear_input", "linear_weight", "linear_output")
BACKWARD_ROLES = ("linear_grad_output", "linear_grad_input")
"""TE 2.14's CustomRecipeState roles for a te.Linear: qfactory(role) is called once per role
(pytorch/quantization.py:1357-1407)."""


def _fp8_dtype(recipe: Recipe, forward: bool) -> torch.dtype:
    """pytorch/quantization.py:137-143 (`get_fp8_te_dtype`): E4M3 for E4M3, and for HYBRID's
    forward tensors; E5M2 for HYBRID's gradients."""
    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and forward):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def _refuse(variant: str):
    raise NotImplementedError(f"transformer_engine test double: {variant} is not modelled by the "
                              "test double")


def _no_amax_epsilon(name: str, *qparams) -> None:
    if any(q.amax_epsilon != 0.0 for q in qparams):
        _refuse(f"{name} with QParams.amax_epsilon != 0")


def make_quantizers(recipe: Recipe) -> "dict | None":
    """TE's `CustomRecipeState.make_quantizers` for one GEMM: {role: qfactory(role)} (None for the
    built-in recipes, whose quantizers `quantizers_of` describes). TE 2.14's protocol
    (quantization.py:1383-1407): from 2.16 the qfactory gets a QuantizerRole and may not return
    None, which the double does not model."""
    if not recipe.custom():
        return None
    if version_tuple() >= (2, 16):
        raise NotImplementedError(f"transformer_engine test double: CustomRecipe on TE {VERSION} (the "
                                  "QuantizerRole qfactory protocol of TE >= 2.16 is not modelled)")
    return {role: recipe.qfactory(role) for role in FORWARD_ROLES + BACKWARD_ROLES}


def _reference_quantizers() -> dict:
    return {role: nvfp4_ref_rht_2d_quantizer_factory(role) for role in FORWARD_ROLES + BACKWARD_ROLES}


def _same_quantizer(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (type(a) is type(b) is NVFP4QuantizerRef and a.settings() == b.settings()
            and (a.rowwise_usage, a.columnwise_usage) == (b.rowwise_usage, b.columnwise_usage))


def quantizers_of(recipe: Recipe, quantizers: "dict | None" = None) -> LinearQuantizers:
    """The quantizers `recipe`'s GEMMs run in a te.Linear, or NotImplementedError naming the
    variant the double does not model. `quantizers`: a CustomRecipe's, from `make_quantizers`."""
    kind = type(recipe).__name__
    if recipe.float8_block_scaling():
        # quantization.py:1209-1279: Float8BlockQuantizer per operand, its dtype from
        # get_fp8_te_dtype, force_pow_2_scales / amax_epsilon from the operand's QParams and
        # block_scaling_dim from x_ / w_ / grad_block_scaling_dim (recipe/__init__.py:345-347).
        qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        if len({q.power_2_scale for q in qparams}) > 1:
            _refuse("Float8BlockScaling with power-of-two scales on some operands only")
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
        if dims != (1, 2, 1):
            _refuse(f"Float8BlockScaling with block dims (x, w, grad) = {dims} (only (1, 2, 1))")
        _no_amax_epsilon(kind, *qparams)
        pow2 = recipe.fp8_quant_fwd_inp.power_2_scale
        return LinearQuantizers(
            "blockwise",
            input=TEQuantizer("float8_block", _fp8_dtype(recipe, True), block_dim=1, pow2=pow2),
            weight=TEQuantizer("float8_block", _fp8_dtype(recipe, True), block_dim=2, pow2=pow2),
            grad_output=TEQuantizer("float8_block", _fp8_dtype(recipe, False), block_dim=1, pow2=pow2))
    if recipe.float8_current_scaling():
        # quantization.py:1130-1138: Float8CurrentScalingQuantizer(get_fp8_te_dtype(recipe, forward));
        # Linear sets force_pow_2_scales / amax_epsilon per operand from the recipe's QParams
        # (module/linear.py:1594-1639, `_customize_quantizers_float8_current_scaling`).
        qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        if any(q.power_2_scale for q in qparams):
            _refuse("Float8CurrentScaling with power-of-two scales (QParams.power_2_scale=True)")
        _no_amax_epsilon(kind, *qparams)
        return LinearQuantizers(
            "tensorwise",
            input=TEQuantizer("float8_current", _fp8_dtype(recipe, True)),
            weight=TEQuantizer("float8_current", _fp8_dtype(recipe, True)),
            grad_output=TEQuantizer("float8_current", _fp8_dtype(recipe, False)))
    if recipe.mxfp8():
        # quantization.py:1169-1173: MXFP8Quantizer(get_fp8_te_dtype(recipe, mode == "forward")).
        if recipe.fp8_format != Format.E4M3:
            _refuse(f"MXFP8BlockScaling(fp8_format={recipe.fp8_format.name}) (E5M2 gradients)")
        mx = TEQuantizer("mxfp8", torch.float8_e4m3fn)
        return LinearQuantizers("mxfp8", input=mx, weight=mx, grad_output=mx)
    if recipe.nvfp4():
        # quantization.py:1309-1354: NVFP4Quantizer per operand with_rht (and its post-RHT amax),
        # with_2d_quantization and stochastic_rounding from the operand's QParams, which
        # recipe/__init__.py:454-476 sets from disable_rht / disable_2d_quantization /
        # disable_stochastic_rounding (the NVTE_NVFP4_DISABLE_* switches, :441-445).
        off = [name for name, flag in (("disable_rht", recipe.disable_rht),
                                       ("disable_2d_quantization", recipe.disable_2d_quantization)) if flag]
        if off:
            _refuse(f"NVFP4BlockScaling({', '.join(f'{n}=True' for n in off)})")
        return LinearQuantizers("nvfp4", input=_nvfp4(recipe.fp4_quant_fwd_inp),
                                weight=_nvfp4(recipe.fp4_quant_fwd_weight),
                                grad_output=_nvfp4(recipe.fp4_quant_bwd_grad))
    if recipe.delayed():
        _refuse("DelayedScaling (per-tensor scales from an amax history)")
    if recipe.custom():
        # custom_recipes/quantization_nvfp4.py:17-47: RHT 1x16 for the input and grad output, 16x16
        # tiles for the weight, none for the outputs; NVFP4QuantizerRef has no stochastic rounding
        # (its cast_to_fp4x2 rounds to nearest, :50-72).
        quantizers = make_quantizers(recipe) if quantizers is None else quantizers
        reference = _reference_quantizers()
        if all(_same_quantizer(quantizers.get(role), reference[role]) for role in reference):
            return LinearQuantizers("nvfp4", input=TEQuantizer("nvfp4", torch.uint8, rht=True),
                                    weight=TEQuantizer("nvfp4", torch.uint8, block_dim=2),
                                    grad_output=TEQuantizer("nvfp4", torch.uint8, rht=True))
        got = {role: (None if q is None else type(q).__name__) for role, q in quantizers.items()}
        _refuse(f"CustomRecipe with quantizers {got} (only TE's reference NVFP4 factory, "
                "nvfp4_ref_rht_2d_quantizer_factory, is mapped)")
    _refuse(f"recipe {kind}")


def _nvfp4(qparams) -> TEQuantizer:
    return TEQuantizer("nvfp4", torch.uint8, block_dim=2 if qparams.fp4_2d_quantization else 1,
                       rht=qparams.random_hadamard_transform, stochastic=qparams.stochastic_rounding)


def check_kernels(recipe: Recipe) -> None:
    """The GPU checks TE 2.14's kernels make (after `check_recipe_support`), on the double's
    capability: NVFP4 needs SM100+; on SM100+ blockwise FP8 is emulated with MXFP8 and needs
    power-of-two scales. RuntimeError as TE's NVTE_CHECK raises."""
    capability = get_device_compute_capability()
    # NVFP4's cast kernels are compiled for Blackwell only (common/util/ptx.cuh:709-711 and 746-748:
    # "FP4 cvt PTX instructions are architecture-specific"); autocast_enter asserts it first
    # (pytorch/quantization.py:598-600).
    if recipe.nvfp4() and capability < (10, 0):
        raise RuntimeError(f"NVFP4 kernels need compute capability 10.0 or higher, this GPU is "
                           f"{capability[0]}.{capability[1]} (transformer_engine test double)")
    # common/transpose/quantize_transpose_square_blockwise.cu:490-492 and
    # quantize_transpose_vector_blockwise.cu:533-536: NVTE_CHECK(pow_2_scale, ...) on SM100+.
    if recipe.float8_block_scaling() and capability >= (10, 0) and not recipe.fp8_quant_fwd_inp.power_2_scale:
        raise RuntimeError("On Blackwell and newer, the FP8 block scaling recipe is emulated with MXFP8, "
                           "which requires using power of two scaling factors.")


def _family(recipe: Recipe):
    for family in ("delayed", "mxfp8", "float8_current_scaling", "float8_block_scaling", "nvfp4"):
        if getattr(recipe, family)():
            return family
    return None  # custom recipes always get new quantizers


def quantizer_recipe(held: "Recipe | None", current: Recipe) -> Recipe:
    """The recipe whose settings a module's quantizers carry when it runs `current` while holding
    quantizers made for `held` (TE 2.14 `TransformerEngineBaseModule.set_meta_tensor`).

    A module keeps its quantizers when the new recipe is of the same family, so options of a
    same-class switch (e.g. Float8CurrentScaling E4M3 -> HYBRID) are NOT applied (TE issue #3157);
    only current scaling's power_2_scale / amax_epsilon are re-read from the new recipe
    (`Linear.set_meta_tensor`). Another family, or a CustomRecipe, gets new quantizers from `current`.
    """
    family = _family(current)
    if held is None or family is None or family != _family(held):
        return current
    if family == "float8_current_scaling":
        kept = copy.copy(held)
        for field in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            setattr(kept, field, getattr(current, field))
        return kept
    return held
