"""Layer specs: Megatron's GPT layer specs with SNIP's planned linears put in.

The planned linears go in through the spec, as Megatron intends, rather than by patching modules
after construction; which spec fields hold them is the model family's adapter's knowledge
(`models.gpt_spec.replace_planned_linears`, re-exported here).
"""

from __future__ import annotations

from snip_megatron.models.gpt_spec import replace_duplicated_linears, replace_mtp_planned_linears, replace_planned_linears

__all__ = ["BACKENDS", "get_layer_spec", "get_local_layer_spec", "get_moe_block_spec", "get_mtp_block_spec",
           "get_snip_layer_spec", "get_te_layer_spec", "replace_planned_linears", "with_emulated_linears",
           "with_local_mla_core"]

BACKENDS = ("emulated", "local", "te")
"""Planned-linear backends: SNIP's emulated linears (any device, any plan), Megatron's plain local
linears (a BF16 reference), Transformer Engine's linears (planned through quant_recipe)."""


def get_local_layer_spec(normalization: str = "RMSNorm", multi_latent_attention: bool = False,
                         qk_layernorm: bool = False, num_experts: "int | None" = None, moe_grouped_gemm: bool = False):
    """Megatron's own local (non-TE) GPT layer spec (an MoE layer's with `num_experts`); with
    multi-latent attention, a core attention that takes MLA's head widths and down-projections
    duplicated over TP (megatron/mla.py says why)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=normalization, multi_latent_attention=multi_latent_attention,
                                    qk_layernorm=qk_layernorm, num_experts=num_experts,
                                    moe_grouped_gemm=moe_grouped_gemm)
    return with_local_mla(spec) if multi_latent_attention else spec


def with_local_mla(spec):
    """A local GPT layer spec (or each layer of a block spec) whose MLA, if it has one, builds on
    the local spec: down-projections duplicated over TP and SNIP's core attention."""
    from snip_megatron.megatron.mla import DuplicatedDownProjection
    from snip_megatron.models import gpt_spec

    def one(layer_spec):
        if not gpt_spec.is_mla_spec(layer_spec):
            return layer_spec
        return with_local_mla_core(replace_duplicated_linears(layer_spec, DuplicatedDownProjection))

    return gpt_spec.map_layer_specs(spec, one)


def with_local_mla_core(spec):
    """An MLA layer spec whose Megatron local core attention (which cannot build MLA) is SNIP's
    LocalMLACore; any other spec (TE's core, a dense layer) as it is."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from snip_megatron.megatron.mla import LocalMLACore
    from snip_megatron.models import gpt_spec

    if gpt_spec.is_mla_spec(spec) and spec.submodules.self_attention.submodules.core_attention is DotProductAttention:
        spec.submodules.self_attention.submodules.core_attention = LocalMLACore
    return spec


def with_emulated_linears(spec):
    """A GPT layer spec (dense, MLA, MoE: its experts' and shared experts' linears too), or each layer
    of a block spec, with SNIP's emulated linears as its planned linears."""
    from snip_megatron.emulation.parallel_linear import (QuantColumnParallelLinear,
                                                         QuantRowParallelLinear)
    from snip_megatron.models import gpt_spec

    def one(layer_spec):
        down = None
        if gpt_spec.is_mla_spec(layer_spec):
            from snip_megatron.megatron.mla import QuantDownProjection as down
        return with_local_mla_core(replace_planned_linears(layer_spec, QuantColumnParallelLinear,
                                                           QuantRowParallelLinear, down))

    return gpt_spec.map_layer_specs(spec, one)


def get_snip_layer_spec(normalization: str = "RMSNorm", multi_latent_attention: bool = False):
    """The local spec with SNIP's emulated quantized linears as the planned linears."""
    return with_emulated_linears(get_local_layer_spec(normalization, multi_latent_attention))


def get_te_layer_spec(multi_latent_attention: bool = False):
    """Megatron's Transformer Engine GPT layer spec (GPU; TE linears read quant_recipe themselves)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=multi_latent_attention)


def _router_gemm_without_te() -> None:
    """megatron-core 0.16's router GEMM tests `te_general_gemm is not None` but leaves the name
    undefined when Transformer Engine is absent (moe_utils.py imports it in a try block with no
    fallback; 0.17+ sets None), so every MoE forward raises NameError. Give it the None its own test
    expects: Megatron then runs its torch GEMM, as later versions do without TE."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def get_moe_block_spec(config, backend: str = "emulated", vp_stage=None):
    """Megatron's decoder block spec of an MoE GPT (`moe_layer_freq` mixes dense and MoE layers;
    this stage's layers), with SNIP's emulated linears for the emulated backend (the experts of the
    local spec's SequentialMLP included)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    _router_gemm_without_te()
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; valid: {', '.join(BACKENDS)}")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=backend == "te",
                                      normalization=config.normalization, vp_stage=vp_stage)
    if backend == "emulated":
        return with_emulated_linears(spec)
    return with_local_mla(spec) if backend == "local" else spec


def get_layer_spec(backend: str = "emulated", normalization: str = "RMSNorm", multi_latent_attention: bool = False):
    """Spec by backend name: "emulated" (SNIP linears, any device), "local" (Megatron's plain
    linears, a reference), "te" (Transformer Engine, GPU only)."""
    if backend == "emulated":
        return get_snip_layer_spec(normalization, multi_latent_attention)
    if backend == "local":
        return get_local_layer_spec(normalization, multi_latent_attention)
    if backend == "te":
        if normalization != "RMSNorm":
            raise ValueError("the TE spec takes its normalization from TransformerConfig.normalization")
        return get_te_layer_spec(multi_latent_attention)
    raise ValueError(f"unknown linear backend {backend!r}; valid: {', '.join(BACKENDS)}")


def get_mtp_block_spec(config, layer_spec, backend: str = "emulated", vp_stage=None):
    """Megatron's multi-token-prediction block spec for one chunk (None on a chunk without MTP
    layers), built from the decoder's layer spec as Megatron's GPT builders build it: its inner layer
    has the decoder's planned linears; for the emulated backend its eh_proj is SNIP's too."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    block = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=backend == "te", vp_stage=vp_stage)
    if block is None or backend != "emulated":
        return block
    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear

    return replace_mtp_planned_linears(block, QuantColumnParallelLinear, lambda spec: spec)
