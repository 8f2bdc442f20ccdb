"""Precision -> the per-module config dict a planned linear's `finish_init` reads, for one GPU.

Pure Python: no Transformer Engine needed, so it is tested on CPU. The TE dicts are what
Megatron's `TEQuantizationParams.parse_from_config` accepts (megatron-core 0.16.1 and 0.19.2), and
everything in them comes from the run's one `Formats` value: the FP8 recipe and element format,
and for FP4 TE's NVFP4 recipe (SM100+ only: before that TE has no FP4 SNIP plans, see te.gpu). The
scale switches TE reads from its environment are checked at start-up
(snip_megatron.te.resolve), not here.
"""

from __future__ import annotations

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.te.gpu import fp4_unavailable, fp8_unavailable
from snip_megatron.te.options import TEOptions

TE_CONFIG_TYPE_KEY = "transformer_engine_config_type"


def te_recipe(precision: "Precision | str", *, formats: Formats, sm: int,
              options: TEOptions = TEOptions()) -> dict:
    """The `training_recipe` dict (TEQuantizationRecipe fields) for one precision on SM`sm`;
    ValueError saying why when TE cannot run it there.

    Both override flags are set, so the module runs exactly its planned precision whether or not
    a global `--fp8-format`/`--fp4-format` autocast is open around it: `override_quantized_autocast`
    replaces (or, for BF16, disables) an enclosing FP8/FP4 autocast, and
    `override_nonquantized_autocast` opens the module's own autocast when no global one is on.
    """
    p = Precision.parse(precision)
    recipe: dict = {"override_quantized_autocast": True, "override_nonquantized_autocast": True}
    if p is Precision.FP8:
        reason = fp8_unavailable(formats.fp8_recipe, sm)
        if reason:
            raise ValueError(f"FP8 {formats.fp8_recipe}: {reason}")
        recipe["fp8_quantization_recipe"] = formats.fp8_recipe
        recipe["fp8_format"] = formats.effective_fp8_format
        recipe["tp_only_amax_red"] = options.tp_only_amax_red
    elif p is Precision.FP4:
        reason = fp4_unavailable(formats.fp4_recipe, sm)
        if reason:
            raise ValueError(f"FP4 {formats.fp4_recipe}: {reason}")
        recipe["fp4_quantization_recipe"] = formats.fp4_recipe
    # BF16: neither recipe set -> Megatron opens fp8_autocast(enabled=False), forcing high precision.
    return recipe


def te_params(precision: "Precision | str", *, formats: Formats, sm: int,
              options: TEOptions = TEOptions()) -> dict:
    """The full TEQuantizationParams config dict (training recipe; evaluation uses the same)."""
    return {TE_CONFIG_TYPE_KEY: "TEQuantizationParams",
            "training_recipe": te_recipe(precision, formats=formats, sm=sm, options=options)}


def te_config_dict(*, formats: Formats, sm: int, options: TEOptions = TEOptions()) -> dict[str, dict]:
    """{precision name: TEQuantizationParams dict} for every precision TE runs on SM`sm` in
    `formats`; the others are absent (`te_unavailable` says why)."""
    out = {}
    for p in Precision:
        try:
            out[p.value] = te_params(p, formats=formats, sm=sm, options=options)
        except ValueError:
            continue
    return out


def te_unavailable(*, formats: Formats, sm: int) -> dict[str, str]:
    """{precision name: why TE cannot run it on SM`sm`} for the precisions `te_config_dict` leaves out."""
    out = {}
    for p in Precision:
        try:
            te_recipe(p, formats=formats, sm=sm)
        except ValueError as e:
            out[p.value] = str(e)
    return out


def emulated_params(precision: "Precision | str", formats: Formats = Formats()) -> dict:
    """The config dict SNIP's emulated linears read in `finish_init` (plain JSON: formats travel as
    names, like every quant_recipe config; a variant travels only when it is set)."""
    p = Precision.parse(precision)
    config: dict = {"precision": p.value}
    if p is Precision.FP8:
        config["fp8_recipe"] = formats.fp8_recipe
        if formats.fp8_format is not None:
            config["fp8_format"] = formats.fp8_format
        if formats.fp8_block_scales != "fp32":
            config["fp8_block_scales"] = formats.fp8_block_scales
    elif p is Precision.FP4:
        config["fp4_recipe"] = formats.fp4_recipe
        if formats.fp4_gradient_rounding is not None:
            config["fp4_gradient_rounding"] = formats.fp4_gradient_rounding
    return config


def precision_of_te_params(params) -> Precision:
    """The precision a parsed `TEQuantizationParams` (or its config dict) runs in training."""
    if params is None:
        raise ValueError("module has no TE quantization params (it follows the global autocast)")
    recipe = params["training_recipe"] if isinstance(params, dict) else params.training_recipe
    get = recipe.get if isinstance(recipe, dict) else (lambda k: getattr(recipe, k, None))
    if get("fp4_quantization_recipe") is not None:
        return Precision.FP4
    if get("fp8_quantization_recipe") is not None:
        return Precision.FP8
    return Precision.BF16
