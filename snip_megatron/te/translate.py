"""Precision -> the per-module config a planned linear's `finish_init` reads, for a given GPU.

Pure Python: no Transformer Engine needed, so it is tested on CPU. The TE dicts are what
Megatron's `TEQuantizationParams.parse_from_config` accepts (megatron-core 0.16.1 and 0.19.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.te.options import TEOptions, fp8_recipe_for, has_native_fp4

TE_CONFIG_TYPE_KEY = "transformer_engine_config_type"


@dataclass(frozen=True)
class ModuleConfig:
    """Where a planned linear runs and the quant_recipe config dict its `finish_init` reads."""

    backend: str
    """'te' (a Transformer Engine linear) or 'emulated' (SNIP's emulated linear)."""
    config: dict = field(compare=True, hash=False)
    """The config dict; TEQuantizationParams for 'te', {"precision": ...} for 'emulated'."""


def te_recipe(precision: "Precision | str", *, sm: int, options: TEOptions = TEOptions()) -> dict:
    """The `training_recipe` dict (TEQuantizationRecipe fields) for one precision on SM`sm`.

    Both override flags are set, so the module runs exactly its planned precision whether or not
    a global `--fp8-format`/`--fp4-format` autocast is open around it: `override_quantized_autocast`
    replaces (or, for BF16, disables) an enclosing FP8/FP4 autocast, and
    `override_nonquantized_autocast` opens the module's own autocast when no global one is on.
    """
    p = Precision.parse(precision)
    recipe: dict = {"override_quantized_autocast": True, "override_nonquantized_autocast": True}
    if p is Precision.FP8:
        recipe["fp8_quantization_recipe"] = fp8_recipe_for(sm, options)
        recipe["fp8_format"] = options.fp8_format
        recipe["tp_only_amax_red"] = options.tp_only_amax_red
    elif p is Precision.FP4:
        if not has_native_fp4(sm):
            raise ValueError(f"FP4 has no Transformer Engine kernel on SM{sm} (needs SM100+); "
                             f"run FP4 layers with the emulated linear (TEOptions.fp4_fallback='emulated')")
        recipe["fp4_quantization_recipe"] = options.fp4_recipe
    # BF16: neither recipe set -> Megatron opens fp8_autocast(enabled=False), forcing high precision.
    return recipe


def te_params(precision: "Precision | str", *, sm: int, options: TEOptions = TEOptions()) -> dict:
    """The full TEQuantizationParams config dict (training recipe; evaluation uses the same)."""
    return {TE_CONFIG_TYPE_KEY: "TEQuantizationParams",
            "training_recipe": te_recipe(precision, sm=sm, options=options)}


def emulated_params(precision: "Precision | str", formats: Formats = Formats()) -> dict:
    """The config dict SNIP's emulated linears read in `finish_init` (plain JSON: recipes travel
    as names, like every quant_recipe config)."""
    p = Precision.parse(precision)
    config: dict = {"precision": p.value}
    if p is Precision.FP8:
        config["fp8_recipe"] = formats.fp8_recipe
    elif p is Precision.FP4:
        config["fp4_recipe"] = formats.fp4_recipe
    return config


def module_config(precision: "Precision | str", *, sm: int,
                  options: TEOptions = TEOptions()) -> ModuleConfig:
    """Where and how one precision runs on SM`sm`: TE where the GPU has the kernels; FP4 before
    Blackwell goes to the emulated linear (or raises, if `options.fp4_fallback == 'error'`)."""
    p = Precision.parse(precision)
    if p is Precision.FP4 and not has_native_fp4(sm):
        if options.fp4_fallback == "error":
            raise ValueError(f"FP4 needs SM100+ for Transformer Engine, this GPU is SM{sm}, and "
                             f"TEOptions.fp4_fallback='error'; set it to 'emulated'")
        return ModuleConfig("emulated", emulated_params(p, Formats(fp4_recipe=options.fp4_recipe)))
    return ModuleConfig("te", te_params(p, sm=sm, options=options))


def te_config_dict(*, sm: int, options: TEOptions = TEOptions()) -> dict[str, ModuleConfig]:
    """{precision name: ModuleConfig} for every precision, on SM`sm`."""
    return {p.value: module_config(p, sm=sm, options=options) for p in Precision}


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
