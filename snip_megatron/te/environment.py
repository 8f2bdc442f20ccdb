"""The environment switches Transformer Engine reads that change what a recipe computes, per TE
version, and what SNIP does with each.

Megatron builds each module's recipe with no options but the FP8 element format
(`Float8BlockScaling(fp8_format=...)`, `NVFP4BlockScaling()`, ...), so every recipe field TE fills
from its environment at import, and every switch its C++ quantizers read at each call, is part of
what the planned linears run. SNIP either follows a switch (the formats it measures are the ones TE
runs: `TESwitches`, read by `te.resolve.te_formats`) or refuses it at start-up with the fix
(`te.resolve` for the three 2.14 switches SNIP does not emulate, `support/rules/te.py` for the rest).
A switch the installed TE does not read changes nothing and is said at start-up (`unread_notices`).

Read in TE's sources (`SWITCHES`, each with its file:line at v2.14, v2.16, v2.18 and main d0067d0,
2.20.0.dev0; paths under `transformer_engine/`). Not recipe switches, so neither read nor refused:
attention (NVTE_FLASH_ATTN*, NVTE_FUSED_ATTN*, NVTE_DPA_FP8_*, NVTE_FP8_DPA_BWD: FP8 attention is
refused), normalization kernel choices (NVTE_NORM_FWD_USE_CUDNN / _BWD_, NVTE_ZERO_CENTERED_GAMMA_IN_WTYPE,
main's NVTE_CUDNN_MXFP8_NORM_OUTPUT_IN_INPUT_DTYPE), GEMM and grouped-kernel choices that compute the
same products (NVTE_USE_CUTLASS_GROUPED_GEMM, NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM,
main's NVTE_FUSED_GROUP_REQUANTIZE), delayed scaling's NVTE_UNFUSED_FP8_UPDATE (delayed scaling is
refused), the op fuser's NVTE_CUTEDSL_FUSED_GROUPED_MLP* (the op fuser is refused), the checkpoint
loader's NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE (2.16.1+) and build-time switches (NVTE_BUILD_*).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping

FP8_BLOCK_FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
FP8_CURRENT_POW2_SCALES = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
NVFP4_DISABLE_RHT = "NVTE_NVFP4_DISABLE_RHT"
NVFP4_DISABLE_SR = "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"
NVFP4_DISABLE_2D = "NVTE_NVFP4_DISABLE_2D_QUANTIZATION"
BACKWARD_OVERRIDE = "NVTE_BACKWARD_OVERRIDE"
NVFP4_ROW_SCALED = "NVTE_NVFP4_ROW_SCALED_ACTIVATION"
NVFP4_4OVER6 = "NVTE_NVFP4_4OVER6"
NVFP4_4OVER6_E4M3_256 = "NVTE_NVFP4_4OVER6_E4M3_USE_256"
NVFP4_4OVER6_ERR_MODE = "NVTE_NVFP4_4OVER6_ERR_MODE"
NVFP4_4OVER6_FAST_MATH = "NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH"
FAST_MATH = "NVTE_USE_FAST_MATH"

BACKWARD_OVERRIDES = ("high_precision", "dequantized")
"""NVTE_BACKWARD_OVERRIDE's values TE accepts besides unset (common/recipe `_BACKWARD_OVERRIDES`)."""
FOUR_OVER_SIX_SCOPES = ("none", "weights", "activations", "all")
"""NVTE_NVFP4_4OVER6 and NVTE_NVFP4_4OVER6_E4M3_USE_256's values (`_NVFP4_4OVER6_SCOPES`)."""
FOUR_OVER_SIX_ERR_MODES = ("MAE", "MSE")
"""NVTE_NVFP4_4OVER6_ERR_MODE's values, upper-cased (`_NVFP4_4OVER6_ERR_MODES`)."""


@dataclass(frozen=True)
class Switch:
    """One environment switch of TE that changes what a recipe computes."""

    name: str
    since: tuple[int, int]
    """The first TE (major, minor) that reads it."""
    recipes: str
    """Which recipes it changes: "all" (every recipe class), "blockwise", "tensorwise" or "nvfp4"."""
    read: str
    """How TE reads it: "python" (a recipe field's default, `os.getenv` at import) or "c++"
    (`transformer_engine::getenv<bool>` at each quantize: "1" is on, "0" or empty off)."""
    snip: str
    """What SNIP does: "followed" (the formats SNIP measures follow it), "refused" (a run that could
    use a recipe it changes is refused unless it is at TE's default), or "with 4over6" (acts only
    when NVTE_NVFP4_4OVER6 is on, which is refused; an invalid value is refused, as TE asserts)."""
    effect: str
    """What TE then computes, in a few words (the start-up refusal says it)."""
    cited: tuple[tuple[str, str], ...]
    """(TE version, file:line where it is read) at v2.14, v2.16, v2.18 and main."""


_RECIPE = "common/recipe/__init__.py"
SWITCHES: tuple[Switch, ...] = (
    Switch(FP8_CURRENT_POW2_SCALES, (2, 9), "tensorwise", "python", "refused",
           "power-of-two tensorwise FP8 scales",
           (("2.14", f"{_RECIPE}:242"), ("2.16", f"{_RECIPE}:300"), ("2.18", f"{_RECIPE}:302"),
            ("main", f"{_RECIPE}:302"))),
    Switch(FP8_BLOCK_FP32_SCALES, (2, 9), "blockwise", "python", "followed",
           "FP32 blockwise FP8 scales instead of powers of two",
           (("2.14", f"{_RECIPE}:339"), ("2.16", f"{_RECIPE}:417"), ("2.18", f"{_RECIPE}:425"),
            ("main", f"{_RECIPE}:429"))),
    Switch(NVFP4_DISABLE_RHT, (2, 9), "nvfp4", "python", "refused",
           "NVFP4 without the wgrad operands' random Hadamard transform",
           (("2.14", f"{_RECIPE}:441"), ("2.16", f"{_RECIPE}:533"), ("2.18", f"{_RECIPE}:554"),
            ("main", f"{_RECIPE}:558"))),
    Switch(NVFP4_DISABLE_SR, (2, 9), "nvfp4", "python", "followed",
           "NVFP4 gradients rounded to nearest",
           (("2.14", f"{_RECIPE}:443"), ("2.16", f"{_RECIPE}:535"), ("2.18", f"{_RECIPE}:556"),
            ("main", f"{_RECIPE}:560"))),
    Switch(NVFP4_DISABLE_2D, (2, 9), "nvfp4", "python", "refused",
           "NVFP4 weights in 1x16 blocks instead of 16x16 tiles",
           (("2.14", f"{_RECIPE}:445"), ("2.16", f"{_RECIPE}:537"), ("2.18", f"{_RECIPE}:558"),
            ("main", f"{_RECIPE}:562"))),
    Switch(BACKWARD_OVERRIDE, (2, 15), "all", "python", "refused",
           "every FP8/FP4 linear's dgrad and wgrad on high-precision ('high_precision') or dequantized "
           "('dequantized') operands instead of quantized ones (module/linear.py backward_override)",
           (("2.16", f"{_RECIPE}:259,310,368,431,546,644"), ("2.18", f"{_RECIPE}:261,312,370,439,570,680"),
            ("main", f"{_RECIPE}:261,312,372,443,574,692"))),
    Switch(NVFP4_ROW_SCALED, (2, 16), "nvfp4", "python", "refused",
           "NVFP4 activations with one FP32 scale per row (quantization.py row_scaled_nvfp4)",
           (("2.16", f"{_RECIPE}:538"), ("2.18", f"{_RECIPE}:559"), ("main", f"{_RECIPE}:563"))),
    Switch(NVFP4_4OVER6, (2, 17), "nvfp4", "python", "refused",
           "4over6 NVFP4 blocks (each block mapped to 4 or to 6, whichever errs less)",
           (("2.18", f"{_RECIPE}:560"), ("main", f"{_RECIPE}:564"))),
    Switch(NVFP4_4OVER6_E4M3_256, (2, 17), "nvfp4", "python", "with 4over6",
           "256 instead of 448 as the E4M3 scale bound of 4over6 tensors",
           (("2.18", f"{_RECIPE}:561"), ("main", f"{_RECIPE}:565"))),
    Switch(NVFP4_4OVER6_ERR_MODE, (2, 17), "nvfp4", "python", "with 4over6",
           "the error 4over6 compares its candidates by",
           (("2.18", f"{_RECIPE}:562"), ("main", f"{_RECIPE}:566"))),
    Switch(NVFP4_4OVER6_FAST_MATH, (2, 17), "nvfp4", "c++", "with 4over6",
           "approximate math in 4over6's candidate errors",
           (("2.18", "pytorch/csrc/extensions/cast.cpp:1376,1543"),
            ("main", "pytorch/csrc/extensions/cast.cpp:1603,1770"))),
    Switch(FAST_MATH, (2, 12), "nvfp4", "c++", "refused",
           "NVFP4 quantization with approximate reciprocals and without the BF16 round trip of the "
           "Hadamard-transformed copy",
           (("2.14", "pytorch/csrc/extensions/cast.cpp:120,1064; pytorch/csrc/quantizer.cpp:2359"),
            ("2.16", "pytorch/csrc/extensions/cast.cpp:112,1042; pytorch/csrc/quantizer.cpp:2428"),
            ("2.18", "pytorch/csrc/extensions/cast.cpp:186,1365,1535; pytorch/csrc/quantizer.cpp:2663"),
            ("main", "pytorch/csrc/extensions/cast.cpp:187,1592,1762; pytorch/csrc/quantizer.cpp:2686"))),
)
BY_NAME = {s.name: s for s in SWITCHES}


@dataclass(frozen=True)
class TESwitches:
    """TE's import-time recipe switches SNIP follows or refuses in `te.resolve`, as TE reads them
    (`os.getenv(NAME, "0") == "1"`, the same in every TE from 2.9)."""

    fp8_block_fp32_scales: bool
    """Float8BlockScaling with FP32 scales (default: power-of-two scales)."""
    fp8_current_pow2_scales: bool
    """Float8CurrentScaling with power-of-two scales (default: FP32)."""
    nvfp4_disable_rht: bool
    """NVFP4BlockScaling without the random Hadamard transform on the wgrad operands."""
    nvfp4_disable_stochastic_rounding: bool
    """NVFP4BlockScaling rounding gradients to nearest."""
    nvfp4_disable_2d: bool
    """NVFP4BlockScaling with 1x16 weight blocks instead of 16x16 tiles."""

    @classmethod
    def read(cls, environ: "Mapping[str, str] | None" = None) -> "TESwitches":
        env = os.environ if environ is None else environ

        def on(name: str) -> bool:
            return env.get(name, "0") == "1"

        return cls(fp8_block_fp32_scales=on(FP8_BLOCK_FP32_SCALES),
                   fp8_current_pow2_scales=on(FP8_CURRENT_POW2_SCALES),
                   nvfp4_disable_rht=on(NVFP4_DISABLE_RHT),
                   nvfp4_disable_stochastic_rounding=on(NVFP4_DISABLE_SR),
                   nvfp4_disable_2d=on(NVFP4_DISABLE_2D))

    @property
    def fp8_block_scales(self) -> str:
        """The blockwise scale format TE runs: "fp32" or "pow2"."""
        return "fp32" if self.fp8_block_fp32_scales else "pow2"


def nvte_environ(environ: "Mapping[str, str] | None" = None) -> tuple[tuple[str, str], ...]:
    """The NVTE_* variables of `environ` (default: this process's), sorted: what a run's settings
    carry (RunFacts.te_environ) for the rules on TE's switches."""
    env = os.environ if environ is None else environ
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("NVTE_")))


def te_reads(version: "str | None", name: str) -> bool:
    """Whether Transformer Engine `version` reads switch `name` (False without a TE)."""
    if version is None:
        return False
    from snip_megatron.te.version import version_tuple

    return version_tuple(version) >= BY_NAME[name].since


def _cpp_on(value: "str | None") -> bool:
    # getenv<bool> (common/util/system.h getenv_helper): unset or empty is off, otherwise parsed as a
    # number; "0" is off and anything else is on or an invalid value TE stops on (NVTE_CHECK).
    return value is not None and value.strip() not in ("", "0")


def _cpp_invalid(value: "str | None") -> bool:
    return value is not None and value.strip() not in ("", "0", "1")


def refused(environ: Iterable[tuple[str, str]], version: "str | None", *, fp8: bool,
            nvfp4: bool) -> dict[str, dict]:
    """{switch name: {"value", "effect", "since"}} of the switches TE `version` reads, set in
    `environ` ((name, value) pairs) away from TE's default, that change a recipe of this run
    (`fp8`: it may run FP8; `nvfp4`: it may run TE's NVFP4) and that SNIP does not follow. The three
    2.14 switches `te.resolve` refuses are left to it."""
    env = dict(environ)
    out = {}

    def add(name: str, value: str, effect: "str | None" = None) -> None:
        switch = BY_NAME[name]
        out[name] = {"value": value, "effect": effect or switch.effect,
                     "since": ".".join(map(str, switch.since))}

    if (fp8 or nvfp4) and te_reads(version, BACKWARD_OVERRIDE) and BACKWARD_OVERRIDE in env:
        # os.getenv(NAME, None): any value, even an empty one, is the recipe's backward_override
        value = env[BACKWARD_OVERRIDE]
        operands = {"high_precision": "high-precision", "dequantized": "dequantized"}.get(value)
        add(BACKWARD_OVERRIDE, value, f"every FP8/FP4 linear's dgrad and wgrad GEMMs on {operands} operands instead "
            "of quantized ones (module/linear.py backward_override)" if operands else
            f"an invalid backward_override, which TE's recipes assert against (valid: {', '.join(BACKWARD_OVERRIDES)})")
    if not nvfp4:
        return out
    if te_reads(version, NVFP4_ROW_SCALED) and env.get(NVFP4_ROW_SCALED, "0") == "1":
        add(NVFP4_ROW_SCALED, env[NVFP4_ROW_SCALED])
    if te_reads(version, NVFP4_4OVER6):
        scope = env.get(NVFP4_4OVER6, "none")
        if scope != "none":
            add(NVFP4_4OVER6, scope, None if scope in FOUR_OVER_SIX_SCOPES else
                "an invalid 4over6 scope, which NVFP4BlockScaling asserts against "
                f"(valid: {', '.join(FOUR_OVER_SIX_SCOPES)})")
        bound = env.get(NVFP4_4OVER6_E4M3_256, "all")
        if bound not in FOUR_OVER_SIX_SCOPES:
            add(NVFP4_4OVER6_E4M3_256, bound, "an invalid scope, which NVFP4BlockScaling asserts against "
                f"(valid: {', '.join(FOUR_OVER_SIX_SCOPES)})")
        mode = env.get(NVFP4_4OVER6_ERR_MODE, "MAE")
        if mode.upper() not in FOUR_OVER_SIX_ERR_MODES:
            add(NVFP4_4OVER6_ERR_MODE, mode, "an invalid error mode, which NVFP4BlockScaling asserts against "
                f"(valid: {', '.join(FOUR_OVER_SIX_ERR_MODES)})")
        if _cpp_invalid(env.get(NVFP4_4OVER6_FAST_MATH)):
            add(NVFP4_4OVER6_FAST_MATH, env[NVFP4_4OVER6_FAST_MATH], "an invalid value, which TE's getenv<bool> "
                "stops on at every NVFP4 quantize (valid: 0 or 1)")
    if te_reads(version, FAST_MATH) and _cpp_on(env.get(FAST_MATH)):
        add(FAST_MATH, env[FAST_MATH])
    return out


def unread_notices(environ: Iterable[tuple[str, str]], version: "str | None") -> list[str]:
    """One line per switch of `SWITCHES` set in `environ` that TE `version` does not read yet."""
    if version is None:
        return []
    env = dict(environ)
    return [f"Transformer Engine {version} does not read {s.name} (read from {'.'.join(map(str, s.since))}): "
            "it changes nothing in this run" for s in SWITCHES if s.name in env and not te_reads(version, s.name)]
