"""The one Formats value of a run on Transformer Engine: what TE will run on this GPU, with the
environment TE reads, checked against what the user asked SNIP to measure.

A variant left unset (None) follows TE; one that is set must equal what TE runs, else the run is
refused at start-up with the fix (the flag to drop, or the environment variable to set). A recipe
TE cannot run on this GPU is refused the same way, so no re-plan can ever ask for it.
"""

from __future__ import annotations

from typing import Callable, Mapping

from snip_megatron.formats.precision import FP8_RECIPES, Formats, Precision
from snip_megatron.te import environment as env
from snip_megatron.te.environment import TESwitches
from snip_megatron.te.gpu import fp4_unavailable, fp8_unavailable, generation


def _field(name: str) -> str:
    return name


def te_formats(*, fp8_recipe: str = "blockwise", fp4_recipe: str = "nvfp4", fp8_format: "str | None" = None,
               fp8_block_scales: "str | None" = None, fp4_gradient_rounding: "str | None" = None,
               sm: int, uses=(Precision.FP8, Precision.FP4), environ: "Mapping[str, str] | None" = None,
               support=None, name_of: Callable[[str], str] = _field) -> Formats:
    """The Formats TE runs for this request on SM`sm`; ValueError (every problem, one per line,
    fields named by `name_of`) when TE cannot run it or would run something else.

    uses: the precisions the run may put a linear in (a recipe of an unused precision is not checked).
    support: the installed TE's own answers (snip_megatron.te.installed.TESupport), asked after the
    table of GPU generations.
    """
    uses = {Precision.parse(p) for p in uses}
    switches = TESwitches.read(environ)
    problems: list[str] = []
    block_scales = "fp32" if fp8_block_scales is None else fp8_block_scales
    if Precision.FP8 in uses:
        reason = fp8_unavailable(fp8_recipe, sm, support)
        if reason:
            others = [r for r in FP8_RECIPES if r != fp8_recipe and fp8_unavailable(r, sm, support) is None]
            choose = (f"choose {name_of('fp8_recipe')} {' or '.join(others)}" if others
                      else "no FP8 recipe runs here")
            problems.append(f"{name_of('fp8_recipe')}={fp8_recipe!r}: {reason}; {choose}, or drop fp8 from "
                            f"{name_of('precisions')}")
        if fp8_recipe == "blockwise":
            block_scales = _blockwise_scales(fp8_block_scales, switches, sm, name_of, problems)
        if fp8_recipe == "tensorwise" and switches.fp8_current_pow2_scales:
            problems.append(f"{env.FP8_CURRENT_POW2_SCALES}=1 gives TE's tensorwise FP8 power-of-two scales, "
                            "which SNIP does not emulate; unset it")
    gradient_rounding = fp4_gradient_rounding
    if Precision.FP4 in uses:
        gradient_rounding = _fp4_gradient_rounding(fp4_recipe, fp4_gradient_rounding, switches, sm, support,
                                                   name_of, problems)
    if problems:
        raise ValueError(f"{generation(sm)} with Transformer Engine cannot run these formats:\n  - "
                         + "\n  - ".join(problems))
    return Formats(fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe, fp8_format=fp8_format,
                   fp8_block_scales=block_scales, fp4_gradient_rounding=gradient_rounding)


def _blockwise_scales(asked, switches: TESwitches, sm: int, name_of, problems: list) -> str:
    runs = switches.fp8_block_scales
    setting = f"{env.FP8_BLOCK_FP32_SCALES}={'1' if switches.fp8_block_fp32_scales else 'unset'}"
    if sm >= 100 and runs == "fp32":
        problems.append(f"{setting}: on {generation(sm)} TE emulates blockwise FP8 with MXFP8 GEMMs, which "
                        f"need power-of-two scales; unset {env.FP8_BLOCK_FP32_SCALES}")
    if asked is not None and asked != runs:
        fix = (f"set {env.FP8_BLOCK_FP32_SCALES}=1 where TE is imported" if asked == "fp32"
               else f"unset {env.FP8_BLOCK_FP32_SCALES}")
        problems.append(f"{name_of('fp8_block_scales')}={asked!r}, but TE runs {runs} blockwise scales "
                        f"({setting}); {fix}, or leave {name_of('fp8_block_scales')} unset to follow TE")
    return runs


def _fp4_gradient_rounding(recipe: str, asked, switches: TESwitches, sm: int, support, name_of, problems: list):
    reason = fp4_unavailable(recipe, sm, support)
    if reason:
        problems.append(f"{name_of('fp4_recipe')}={recipe!r}: {reason}. With TE's linears here, drop fp4 from "
                        f"{name_of('precisions')} and every FP4 setting ({name_of('fp4_budget')}, "
                        f"{name_of('fp4_recipe')}, {name_of('fp4_gradient_rounding')}); FP4 runs on SNIP's "
                        "emulated linears (--transformer-impl local), which compute exactly what SNIP measures "
                        "on any GPU")
        return asked
    for on, name, what in ((switches.nvfp4_disable_rht, env.NVFP4_DISABLE_RHT, "the wgrad Hadamard transform"),
                           (switches.nvfp4_disable_2d, env.NVFP4_DISABLE_2D, "16x16 weight tiles")):
        if on:
            problems.append(f"{name}=1 turns off NVFP4's {what}, which SNIP does not emulate; unset it")
    runs = "nearest" if switches.nvfp4_disable_stochastic_rounding else "stochastic"
    if asked is not None and asked != runs:
        fix = f"set {env.NVFP4_DISABLE_SR}=1" if asked == "nearest" else f"unset {env.NVFP4_DISABLE_SR}"
        problems.append(f"{name_of('fp4_gradient_rounding')}={asked!r}, but TE's NVFP4 rounds gradients "
                        f"{'to nearest' if runs == 'nearest' else 'stochastically'} "
                        f"({env.NVFP4_DISABLE_SR}={'1' if runs == 'nearest' else 'unset'}); {fix}, or leave "
                        f"{name_of('fp4_gradient_rounding')} unset to follow TE")
    return runs


def what_runs(formats: Formats, sm: int, uses=(Precision.FP8, Precision.FP4)) -> str:
    """One line: what each planned precision runs on SM`sm`, e.g. "SM100 (Blackwell): FP8 blockwise
    (e4m3, pow2 scales) on TE kernels via MXFP8 GEMMs; FP4 nvfp4 (stochastic gradient rounding) on
    TE's NVFP4 kernels"."""
    uses = {Precision.parse(p) for p in uses}
    parts = []
    if Precision.FP8 in uses:
        via = " via MXFP8 GEMMs" if formats.fp8_recipe == "blockwise" and sm >= 100 else ""
        parts.append(f"FP8 {formats.describe('fp8')} on TE kernels{via}")
    if Precision.FP4 in uses:
        parts.append(f"FP4 {formats.describe('fp4')} on TE's NVFP4 kernels")
    if not parts:
        parts.append("BF16 only")
    return f"{generation(sm)}: " + "; ".join(parts)
