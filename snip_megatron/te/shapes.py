"""Which planned linears Transformer Engine cannot run in FP8 or FP4 because of their shapes.

TE 2.14 asserts, at every FP8/FP4 forward of a linear, that the input and the weight have a
product of leading dims divisible by 8 and a last dim divisible by 16 (`pytorch/utils.py`
assert_dim_for_fp8_exec, called by `module/linear.py` and `layernorm_linear.py` on the local
input and weight); its MXFP8 and NVFP4 tensors need both dims divisible by their block, 32 and 16
(`tensor/mxfp8_tensor.py`, `tensor/nvfp4_tensor.py`). cuBLAS's FP8 GEMMs (tensorwise and blockwise)
also need every operand's leading dimension, the GEMM's inner dimension K, to be a multiple of 16
(TE 2.14 `common/gemm/cublaslt_gemm.cu:158-162, 250-254` tensor scaling, `:207-214, 293-300` block
scaling: "Caller must pad"): fprop's K is in_features (the last-dim rule), dgrad's the local
out_features and wgrad's the tokens of the step's input as the GEMM sees it (gathered under
sequence parallelism), which the leading-dims rule only checks for 8. (On SM100 TE's tensorwise
GEMMs may take non-TN layouts whose leading dims are the outer ones; SNIP keeps the one rule.)
A linear that breaks one would crash at its first forward or backward in that precision, so SNIP
keeps it out of that precision from the start (the planner never chooses it) and says so at start-up.

Pure Python: shapes are a rank's local ones, from the model shape and the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory, InventoryEntry, ParallelKind
from snip_megatron.plan import LayerKey
from snip_megatron.shapes import ModelShape

FP8_EXEC_ALIGN = (8, 16)
"""(leading dims, last dim) every FP8/FP4 GEMM operand of a TE linear must divide by."""
RECIPE_ALIGN = {"mxfp8": (32, 32), "nvfp4": (16, 16)}
"""Stricter (leading, last) alignments of the block-scaled recipes' quantized tensors."""
FP8_GEMM_K_ALIGN = 16
"""cuBLAS FP8 GEMMs' inner dimension (their operands' leading dimension) must divide by this
(tensorwise and blockwise; MXFP8's 32 covers it)."""
FP8_GEMM_RECIPES = ("tensorwise", "blockwise")


@dataclass(frozen=True)
class LocalGemm:
    """One rank's view of a planned linear: its weight and the input TE checks."""

    out_features: int
    in_features: int
    tokens: int
    """Leading dims of the input TE checks (sequence x micro-batch, local)."""
    gemm_tokens: "int | None" = None
    """The tokens of the wgrad GEMM (its K), where they differ from `tokens`: the input gathered
    over TP under sequence parallelism."""

    @property
    def wgrad_k(self) -> int:
        return self.tokens if self.gemm_tokens is None else self.gemm_tokens


def local_gemm(entry: InventoryEntry, tokens: int, *, tp: int = 1, sequence_parallel: bool = False) -> LocalGemm:
    """One rank's view of a planned linear of a TP=`tp` layout, `tokens` the local sequence x batch.

    A column-parallel linear's input is sequence-sharded under sequence parallelism (TE checks the
    local input, before its all-gather); a row-parallel one gets the whole sequence."""
    o, i = entry.shape
    if entry.kind is ParallelKind.DUPLICATED:  # its own tokens only, nothing gathered
        return LocalGemm(o, i, tokens // tp if sequence_parallel and tp > 1 else tokens)
    column = entry.kind is ParallelKind.COLUMN
    sharded = column and sequence_parallel and tp > 1  # TE gathers the input before its GEMMs
    return LocalGemm(out_features=o // tp if column else o, in_features=i if column else i // tp,
                     tokens=tokens // tp if sharded else tokens, gemm_tokens=tokens if sharded else None)


def local_gemms(shape: ModelShape, *, tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                micro_batch_size: int = 1) -> dict[str, LocalGemm]:
    """{linear name: its LocalGemm} of a dense GPT layer on one rank of a TP=`tp`, CP=`cp` layout."""
    tokens = shape.seq_length // cp * micro_batch_size
    return {e.key.name: local_gemm(e, tokens, tp=tp, sequence_parallel=sequence_parallel)
            for e in gpt.inventory(shape.with_(num_layers=1))}


def shape_problem(recipe: str, gemm: LocalGemm) -> "str | None":
    """Why TE cannot run `recipe` (blockwise, tensorwise, mxfp8, nvfp4) on `gemm`, or None."""
    lead, last = FP8_EXEC_ALIGN
    rlead, rlast = RECIPE_ALIGN.get(recipe, FP8_EXEC_ALIGN)
    lead, last = max(lead, rlead), max(last, rlast)
    bad = []
    for what, rows, cols in (("weight", gemm.out_features, gemm.in_features),
                             ("input", gemm.tokens, gemm.in_features)):
        if rows % lead or cols % last:
            bad.append(f"{what} {rows}x{cols}")
    if bad:
        return (f"TE's {recipe} needs every operand's leading dims divisible by {lead} and last dim by {last}; "
                f"this rank's {' and '.join(bad)} are not")
    if recipe in FP8_GEMM_RECIPES:
        k = FP8_GEMM_K_ALIGN
        odd = [f"{what} K={n}" for what, n in (("dgrad", gemm.out_features), ("wgrad", gemm.wgrad_k)) if n % k]
        if odd:
            return (f"cuBLAS's FP8 GEMMs ({recipe}) need the inner dimension divisible by {k} (TE: 'Caller must "
                    f"pad'); this rank's {' and '.join(odd)} (dgrad: the local out_features, wgrad: the tokens) "
                    f"are not")
    return None


def te_exclusions(shape: ModelShape, formats: Formats, uses, *, inventory: "Inventory | None" = None, tp: int = 1,
                  sequence_parallel: bool = False, cp: int = 1,
                  micro_batch_size: int = 1) -> dict[LayerKey, dict[Precision, str]]:
    """{LayerKey: {precision: why}} of the planned linears TE cannot run in a precision of `uses`
    (FP8 and FP4 in `formats`) on a rank of the layout; absent: runs all. `inventory`: the model's
    linears (default: the dense GPT of `shape`); `shape` gives the sequence length."""
    inventory = gpt.inventory(shape) if inventory is None else inventory
    tokens = shape.seq_length // cp * micro_batch_size
    recipes = {Precision.FP8: formats.fp8_recipe, Precision.FP4: formats.fp4_recipe}
    wanted = [p for p in (Precision.parse(u) for u in uses) if p in recipes]
    out, by_gemm = {}, {}
    for e in inventory:
        gemm = local_gemm(e, tokens, tp=tp, sequence_parallel=sequence_parallel)
        if gemm not in by_gemm:  # every layer repeats the same few shapes
            by_gemm[gemm] = {p: problem for p in wanted if (problem := shape_problem(recipes[p], gemm)) is not None}
        if by_gemm[gemm]:
            out[e.key] = dict(by_gemm[gemm])
    return out


def describe_exclusions(excluded: dict[LayerKey, dict[Precision, str]]) -> list[str]:
    """One line per linear kind and precision (every layer has the same shapes)."""
    seen: dict[tuple[str, Precision], str] = {}
    for key, reasons in excluded.items():
        for p, why in reasons.items():
            seen.setdefault((key.name, p), why)
    return [f"{name} kept out of {p.value.upper()} in every layer: {why}" for (name, p), why in seen.items()]


NVFP4_FUSED_SPLIT_INNER = 128
"""TE's fused NVFP4 split-quantize of grouped (MoE expert) GEMMs needs the inner dim of what it
quantizes to divide by this; otherwise TE 2.14-2.18 quantizes each split on its unfused path."""


def unfused_grouped_nvfp4(inventory, uses, fp4_recipe: str) -> "str | None":
    """The start-up line of a run whose grouped expert GEMMs TE quantizes to NVFP4 on its unfused
    path (None when it uses the fused one, or plans no NVFP4).

    TE's GroupedLinear quantizes its input (forward) and output gradient (backward) with
    `tex.split_quantize`; an inner dim that is not a multiple of 128 makes it warn once and quantize
    each expert's split alone through `multi_tensor_quantize_impl`, the same `NVFP4Quantizer`
    a dense linear uses (TE 2.14 csrc/extensions/cast.cpp:1425-1436, 1467; v2.16 :1411, v2.18
    :1774, main :2017; the fused kernel's own check, :1293-1294, is only on the fused path). That
    is the arithmetic SNIP measures for each expert (its own scales, Hadamard transform and
    rounding per split), so the run is served, only slower. `inventory`: the model's planned linears."""
    if "fp4" not in [str(getattr(p, "value", p)) for p in uses] or fp4_recipe != "nvfp4":
        return None
    dims = sorted({d for e in inventory if e.experts for d in e.shape if d % NVFP4_FUSED_SPLIT_INNER})
    if not dims:
        return None
    return (f"MoE: the grouped experts' NVFP4 inputs and gradients of inner size {', '.join(map(str, dims))} (not "
            f"multiples of {NVFP4_FUSED_SPLIT_INNER}) are quantized on TE's unfused path, one expert at a time as a "
            "dense linear's are (TE warns 'Unfused NVFP4 quantization fallback'): slower than the fused kernel, "
            "the same arithmetic SNIP measures")
