"""Which snip_megatron formats a TE recipe's GEMMs run in, TE's kernel checks, and TE's rules for
switching recipes.

The double invents no numerics: a recipe is run with our exact emulation of it
(`snip_megatron.formats.Formats(...).spec(precision)`) or refused with NotImplementedError naming
the TE variant our formats lack:

    Float8BlockScaling   -> blockwise   fp8_format E4M3 or HYBRID; FP32 or power-of-two scales
                                        (all three operands alike); block dims (1, 2, 1)
    Float8CurrentScaling -> tensorwise  fp8_format E4M3 or HYBRID; no power-of-two scales
    MXFP8BlockScaling    -> mxfp8       E4M3 only
    NVFP4BlockScaling    -> nvfp4       RHT and 16x16 weights on; stochastic rounding on
                                        (stochastic gradients) or off (nearest)
    CustomRecipe         -> nvfp4 with nearest gradient rounding, when its qfactory hands out
                            exactly TE 2.14's reference NVFP4 quantizers
                            (custom_recipes.quantization_nvfp4.nvfp4_ref_rht_2d_quantizer_factory;
                            refused on TE >= 2.16, whose factories take a QuantizerRole)
    DelayedScaling, any other CustomRecipe: refused

Deliberate difference: the reference quantizer's (and TE's NVFP4 kernels') Hadamard sign vector is
TE's hard-coded one, our emulation's is its own fixed vector; both are orthogonal transforms of the
same structure (the error statistics are alike, the bits are not).
"""

from __future__ import annotations

import copy

from transformer_engine.common.recipe import Format, Recipe
from transformer_engine._double import VERSION, version_tuple
from transformer_engine.pytorch._reference_nvfp4 import (NVFP4QuantizerRef,
                                                          nvfp4_ref_rht_2d_quantizer_factory)
from transformer_engine.pytorch.utils import get_device_compute_capability

FORWARD_ROLES = ("linear_input", "linear_weight", "linear_output")
BACKWARD_ROLES = ("linear_grad_output", "linear_grad_input")
"""TE 2.14's CustomRecipeState roles for a te.Linear: qfactory(role) is called once per role."""

_FP8_FORMATS = {Format.E4M3: "e4m3", Format.HYBRID: "hybrid"}


def _refuse(variant: str):
    raise NotImplementedError(f"transformer_engine test double: {variant} has no emulation in "
                              f"snip_megatron.formats")


def _no_amax_epsilon(name: str, *qparams) -> None:
    if any(q.amax_epsilon != 0.0 for q in qparams):
        _refuse(f"{name} with QParams.amax_epsilon != 0")


def make_quantizers(recipe: Recipe) -> "dict | None":
    """TE's `CustomRecipeState.make_quantizers` for one GEMM: {role: qfactory(role)} (None for the
    built-in recipes, whose quantizers the double does not build). TE 2.14's protocol: from 2.16
    the qfactory gets a QuantizerRole and may not return None, which the double does not model."""
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


def formats_of(recipe: Recipe, quantizers: "dict | None" = None):
    """(precision, snip_megatron Formats) that `recipe`'s GEMMs run, or NotImplementedError naming
    the variant we cannot emulate. `quantizers`: a CustomRecipe's, from `make_quantizers`."""
    from snip_megatron.formats import Formats, Precision

    kind = type(recipe).__name__
    if recipe.float8_block_scaling():
        qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        pow2 = {q.power_2_scale for q in qparams}
        if len(pow2) > 1:
            _refuse("Float8BlockScaling with power-of-two scales on some operands only")
        if recipe.fp8_format not in _FP8_FORMATS:
            _refuse(f"Float8BlockScaling(fp8_format={recipe.fp8_format.name})")
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
        if dims != (1, 2, 1):
            _refuse(f"Float8BlockScaling with block dims (x, w, grad) = {dims} (only (1, 2, 1))")
        _no_amax_epsilon(kind, *qparams)
        return Precision.FP8, Formats(fp8_recipe="blockwise", fp8_format=_FP8_FORMATS[recipe.fp8_format],
                                      fp8_block_scales="pow2" if pow2 == {True} else "fp32")
    if recipe.float8_current_scaling():
        qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        if any(q.power_2_scale for q in qparams):
            _refuse("Float8CurrentScaling with power-of-two scales (QParams.power_2_scale=True)")
        _no_amax_epsilon(kind, *qparams)
        return Precision.FP8, Formats(fp8_recipe="tensorwise", fp8_format=_FP8_FORMATS[recipe.fp8_format])
    if recipe.mxfp8():
        if recipe.fp8_format != Format.E4M3:
            _refuse(f"MXFP8BlockScaling(fp8_format={recipe.fp8_format.name}) (E5M2 gradients)")
        return Precision.FP8, Formats(fp8_recipe="mxfp8")
    if recipe.nvfp4():
        off = [name for name, flag in (("disable_rht", recipe.disable_rht),
                                       ("disable_2d_quantization", recipe.disable_2d_quantization)) if flag]
        if off:
            _refuse(f"NVFP4BlockScaling({', '.join(f'{n}=True' for n in off)})")
        rounding = "nearest" if recipe.disable_stochastic_rounding else "stochastic"
        return Precision.FP4, Formats(fp4_recipe="nvfp4", fp4_gradient_rounding=rounding)
    if recipe.delayed():
        _refuse("DelayedScaling (per-tensor scales from an amax history)")
    if recipe.custom():
        quantizers = make_quantizers(recipe) if quantizers is None else quantizers
        reference = _reference_quantizers()
        if all(_same_quantizer(quantizers.get(role), reference[role]) for role in reference):
            return Precision.FP4, Formats(fp4_recipe="nvfp4", fp4_gradient_rounding="nearest")
        got = {role: (None if q is None else type(q).__name__) for role, q in quantizers.items()}
        _refuse(f"CustomRecipe with quantizers {got} (only TE's reference NVFP4 factory, "
                "nvfp4_ref_rht_2d_quantizer_factory, is mapped)")
    _refuse(f"recipe {kind}")


def format_spec(recipe: Recipe, quantizers: "dict | None" = None):
    """The FormatSpec our `quantized_linear` runs for `recipe`'s three GEMMs."""
    precision, formats = formats_of(recipe, quantizers)
    return formats.spec(precision)


def check_kernels(recipe: Recipe) -> None:
    """The GPU checks TE 2.14's kernels make (after `check_recipe_support`), on the double's
    capability: NVFP4 needs SM100+; on SM100+ blockwise FP8 is emulated with MXFP8 and needs
    power-of-two scales. RuntimeError as TE's NVTE_CHECK raises."""
    capability = get_device_compute_capability()
    if recipe.nvfp4() and capability < (10, 0):
        raise RuntimeError(f"NVFP4 kernels need compute capability 10.0 or higher, this GPU is "
                           f"{capability[0]}.{capability[1]} (transformer_engine test double)")
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
