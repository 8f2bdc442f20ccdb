"""Token-split padding for TE's grouped expert GEMMs (`--moe-grouped-gemm`) under a per-module plan.

TE's grouped FP8/FP4 GEMMs need each expert's token split to be a multiple of an alignment (16 for
FP8, 32 for MXFP8, more for NVFP4), and leave the padding to the caller. Megatron's TEGroupedMLP
pads only under a global `--fp8-format` / `--fp4-format` (transformer/moe/experts.py: Fp8Padding
when `config.fp8 or config.fp4`), which a SNIP plan does not set: its recipes are per module. So
SNIP pads itself (the choice between that and a global flag is in docs/moe.md): a forward
pre-hook on every TEGroupedMLP pads each expert's rows with zero rows of zero routing
probability to the largest alignment its two grouped linears need *now*, and a forward hook drops
those rows from the output, as Megatron's Fp8Padding / Fp8Unpadding do. A zero row adds nothing to
a GEMM's kept outputs, nor to any gradient (its output gradient is zero, its input is zero).

The alignment is Megatron's own for each module's current recipe (`get_fp8_align_size`,
`get_fp4_align_size`), read from its `te_quant_params` at every forward (its evaluation recipe
outside training), so a re-plan that switches a grouped linear's recipe at a step boundary
(`apply_plan`) changes the padding with it. A BF16 module needs none; a model with a global
fp8/fp4 is left to Megatron's padding; while SNIP measures, the grouped linears run unfused and
unquantized (megatron/gemm_view.py), so nothing is padded and the statistics see the routed rows.
"""

from __future__ import annotations

import torch

from snip_megatron.models import gpt


def _recipe_alignment(recipe) -> int:
    if recipe is None:
        return 0
    if getattr(recipe, "fp8_quantization_recipe", None) is not None:
        from megatron.core.fp8_utils import get_fp8_align_size

        return int(get_fp8_align_size(recipe.fp8_quantization_recipe))
    if getattr(recipe, "fp4_quantization_recipe", None) is not None:
        from megatron.core.fp4_utils import get_fp4_align_size

        return int(get_fp4_align_size(recipe.fp4_quantization_recipe))
    return 0


def alignment(linear) -> int:
    """The rows each expert split of `linear` (a TEGroupedLinear) must be a multiple of in its next
    forward: 0 when it runs unquantized (BF16, or unfused while SNIP measures)."""
    if "forward" in vars(linear):  # unfused by the measurement (gemm_view.unfused_grouped)
        return 0
    params = getattr(linear, "te_quant_params", None)
    if params is None:
        return 0
    recipe = params.evaluation_recipe if not linear.training and params.evaluation_recipe is not None \
        else params.training_recipe
    return _recipe_alignment(recipe)


def _pad_rows(t: torch.Tensor, splits: list, padded: list) -> torch.Tensor:
    parts = []
    for part, n, p in zip(t.split(splits), splits, padded):
        parts.append(part)
        if p > n:
            parts.append(part.new_zeros((p - n,) + tuple(part.shape[1:])))
    return torch.cat(parts)


class SplitPadding:
    """The hooks on one TEGroupedMLP (`install` adds them; `remove` takes them off)."""

    def __init__(self, experts):
        self.experts = experts
        # unpadded splits of the forward in flight (a stack: a forward's post hook follows its own
        # pre hook, so the top is always its own, even after a forward that raised left one behind)
        self.pending: list = []
        self.handles = [experts.register_forward_pre_hook(self._pre),
                        experts.register_forward_hook(self._post)]

    def needed(self) -> int:
        e = self.experts
        if getattr(e.config, "fp8", None) or getattr(e.config, "fp4", None):
            return 0  # Megatron pads itself
        return max(alignment(linear) for linear in gpt.grouped_expert_linears(e))

    def _pre(self, module, args):
        align = self.needed()
        hidden, tokens, probs = args[:3]
        splits = [int(n) for n in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        padded = [-(-n // align) * align for n in splits] if align else splits
        self.pending.append(splits if padded != splits else None)
        if padded == splits:
            return None
        new_tokens = torch.tensor(padded, dtype=tokens.dtype, device=tokens.device) \
            if isinstance(tokens, torch.Tensor) else padded
        return (_pad_rows(hidden, splits, padded), new_tokens, _pad_rows(probs, splits, padded)) + tuple(args[3:])

    def _post(self, module, args, output):
        splits = self.pending.pop()
        if splits is None:
            return None
        out, bias = output
        padded = [int(n) for n in (args[1].tolist() if isinstance(args[1], torch.Tensor) else args[1])]
        kept = [part[:n] for part, n in zip(out.split(padded), splits)]
        return torch.cat(kept), bias

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def install(model_chunks) -> list[SplitPadding]:
    """Put the padding hooks on every TEGroupedMLP of `model_chunks` (idempotent)."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    done = []
    for chunk in chunks:
        if getattr(chunk, "_snip_split_padding_done", False):  # once per chunk (called every step)
            continue
        chunk._snip_split_padding_done = True
        for module in chunk.modules():
            if gpt.grouped_expert_linears(module) is not None and getattr(module, "_snip_split_padding", None) is None:
                module._snip_split_padding = SplitPadding(module)
                done.append(module._snip_split_padding)
    return done
