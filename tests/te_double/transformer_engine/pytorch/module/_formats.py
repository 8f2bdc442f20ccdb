"""Which snip_megatron format a TE recipe's GEMMs run in, and TE's rules for switching recipes.

The double invents no numerics: a recipe is run with our exact emulation of it
(`snip_megatron.formats.FormatSpec`) or refused with NotImplementedError naming the TE variant our
formats lack (another engineer adds those formats):

    Float8BlockScaling  -> 'blockwise'   only FP32 scales, E4M3 everywhere, 1x128 / 128x128 / 1x128
    Float8CurrentScaling-> 'tensorwise'  only HYBRID (E4M3 forward, E5M2 gradients), no 2^k scales
    MXFP8BlockScaling   -> 'mxfp8'       only E4M3
    NVFP4BlockScaling   -> 'nvfp4'       only with RHT, stochastic rounding and 16x16 weights on
    DelayedScaling, CustomRecipe         refused
"""

from __future__ import annotations

import copy

from transformer_engine.common.recipe import Format, Recipe

FP8_NAMES = ("blockwise", "tensorwise", "mxfp8")
FP4_NAMES = ("nvfp4",)


def _refuse(variant: str):
    raise NotImplementedError(f"transformer_engine test double: {variant} has no emulation in "
                              f"snip_megatron.formats yet")


def _no_amax_epsilon(name: str, *qparams) -> None:
    if any(q.amax_epsilon != 0.0 for q in qparams):
        _refuse(f"{name} with QParams.amax_epsilon != 0")


def format_name(recipe: Recipe) -> str:
    """Our recipe name for `recipe`, or NotImplementedError naming the variant we cannot emulate."""
    kind = type(recipe).__name__
    if recipe.float8_block_scaling():
        qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        if any(q.power_2_scale for q in qparams):
            _refuse("Float8BlockScaling with power-of-two scales (QParams.power_2_scale=True, TE's "
                    "default; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 at import gives FP32 scales)")
        if recipe.fp8_format != Format.E4M3:
            _refuse(f"Float8BlockScaling(fp8_format={recipe.fp8_format.name}) (E5M2 gradients)")
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
                recipe.grad_block_scaling_dim)
        if dims != (1, 2, 1):
            _refuse(f"Float8BlockScaling with block dims (x, w, grad) = {dims} (only (1, 2, 1))")
        _no_amax_epsilon(kind, *qparams)
        return "blockwise"
    if recipe.float8_current_scaling():
        qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        if any(q.power_2_scale for q in qparams):
            _refuse("Float8CurrentScaling with power-of-two scales (QParams.power_2_scale=True)")
        if recipe.fp8_format != Format.HYBRID:
            _refuse(f"Float8CurrentScaling(fp8_format={recipe.fp8_format.name}) (E4M3-only "
                    f"tensorwise: our 'tensorwise' is HYBRID, E5M2 gradients)")
        _no_amax_epsilon(kind, *qparams)
        return "tensorwise"
    if recipe.mxfp8():
        if recipe.fp8_format != Format.E4M3:
            _refuse(f"MXFP8BlockScaling(fp8_format={recipe.fp8_format.name}) (E5M2 gradients)")
        return "mxfp8"
    if recipe.nvfp4():
        off = [name for name, flag in (("disable_rht", recipe.disable_rht),
                                       ("disable_stochastic_rounding",
                                        recipe.disable_stochastic_rounding),
                                       ("disable_2d_quantization", recipe.disable_2d_quantization))
               if flag]
        if off:
            _refuse(f"NVFP4BlockScaling({', '.join(f'{n}=True' for n in off)})")
        return "nvfp4"
    if recipe.delayed():
        _refuse("DelayedScaling (per-tensor scales from an amax history)")
    if recipe.custom():
        _refuse("CustomRecipe (user quantizer factories)")
    _refuse(f"recipe {kind}")


def format_spec(recipe: Recipe):
    """The FormatSpec our `quantized_linear` runs for `recipe`'s three GEMMs."""
    from snip_megatron.formats import FormatSpec

    name = format_name(recipe)
    if name in FP4_NAMES:
        return FormatSpec.for_precision("fp4", fp4_recipe=name)
    return FormatSpec.for_precision("fp8", fp8_recipe=name)


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
    (`Linear.set_meta_tensor`). Another family gets new quantizers from `current`.
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
