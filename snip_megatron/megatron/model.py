"""Build a Llama-like Megatron-Core GPTModel (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from snip_megatron.shapes import ModelShape

# name -> (activation function, gated): SwiGLU is silu with a gated linear unit, as in Llama.
ACTIVATIONS = {
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
    "gelu": (F.gelu, False),
    "relu": (F.relu, False),
}

# Fused kernels Megatron-Core's local path takes from Transformer Engine or apex (notes/platform.md).
FUSED_KERNELS_OFF = dict(
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
)
# ... and without a GPU the weights are also initialised on the CPU.
CPU_SAFE_FLAGS = dict(use_cpu_initialization=True, **FUSED_KERNELS_OFF)


def platform_flags(cuda: bool, te: bool) -> dict:
    """TransformerConfig flags for where the model runs: CPU, a GPU without Transformer Engine
    (the emulated linears: fused kernels off), or a GPU with it (Megatron's defaults)."""
    if not cuda:
        return dict(CPU_SAFE_FLAGS)
    return {} if te else dict(FUSED_KERNELS_OFF)


def te_importable() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("transformer_engine") is not None
    except Exception:  # a broken TE install counts as none
        return False


def validate_layout(shape: ModelShape, tp: int = 1, pp: int = 1, vpp: int | None = None,
                    activation: str = "swiglu") -> None:
    """Raise ValueError naming the field when `shape` cannot be split TP x PP (x VPP)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if shape.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={shape.num_attention_heads} is not divisible by "
                         f"tensor_model_parallel_size={tp}")
    if shape.num_query_groups % tp:
        raise ValueError(f"num_query_groups={shape.num_query_groups} is not divisible by "
                         f"tensor_model_parallel_size={tp}")
    if shape.ffn_hidden_size % tp:
        raise ValueError(f"ffn_hidden_size={shape.ffn_hidden_size} is not divisible by "
                         f"tensor_model_parallel_size={tp}")
    chunks = pp * (vpp or 1)
    if shape.num_layers % chunks:
        what = f"pipeline_model_parallel_size={pp}" + (f" x virtual_pipeline_model_parallel_size={vpp}" if vpp else "")
        raise ValueError(f"num_layers={shape.num_layers} is not divisible by {what}")


def check_mla_buildable() -> None:
    """megatron-core 0.16's MLASelfAttention asks `isinstance(linear_proj, TELinear)` with TELinear
    None when Transformer Engine is absent, so it cannot be built there: refused with the way out."""
    from snip_megatron.megatron.apply import megatron_core_version

    # compat: 0.16's MLASelfAttention needs TE; 0.17+ builds on the local spec too.
    if megatron_core_version() < (0, 17) and not te_importable():
        raise ValueError("multi-latent attention on megatron-core < 0.17 needs Transformer Engine (its "
                         "MLASelfAttention checks isinstance(linear_proj, TELinear), None without TE): use "
                         "megatron-core >= 0.19 (the prod lane) or install Transformer Engine")


def make_transformer_config(shape: ModelShape, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                            activation: str = "swiglu", params_dtype: torch.dtype = torch.float32,
                            quant_recipe=None, sequence_parallel: bool = False, mla=None, **overrides):
    """A TransformerConfig for `shape`; flags for the platform (`platform_flags`), then `overrides`.
    `mla` (models.gpt.MLADims): an MLATransformerConfig with multi-latent attention of those widths
    (RoPE as the dense model's, not YaRN)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    validate_layout(shape, tp, pp, vpp, activation)
    activation_func, gated = ACTIVATIONS[activation]
    bf16 = params_dtype == torch.bfloat16
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        activation_func=activation_func,
        gated_linear_unit=gated,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        quant_recipe=quant_recipe,
    )
    cuda = torch.cuda.is_available()
    kwargs.update(platform_flags(cuda, te_importable() if cuda else False))
    if mla is not None:
        check_mla_buildable()
        # every head has its own keys and values (no GQA in MLA)
        kwargs.update(dataclasses.asdict(mla), multi_latent_attention=True, rope_type="rope",
                      num_query_groups=shape.num_attention_heads)
    kwargs.update(overrides)
    return (MLATransformerConfig if mla is not None else TransformerConfig)(**kwargs)


def build_gpt_model(shape: ModelShape, *, config=None, backend: str = "emulated",
                    vp_stage: int | None = None, **config_kwargs):
    """One GPTModel chunk for this rank's pipeline stage (and virtual stage `vp_stage`).

    Parallel state must be initialised (snip_megatron.megatron.runtime). `config_kwargs` go to
    `make_transformer_config` when no `config` is given.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from snip_megatron.megatron.spec import get_layer_spec, get_moe_block_spec, get_mtp_block_spec

    if config is None:
        config = make_transformer_config(
            shape, tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            vpp=ps.get_virtual_pipeline_model_parallel_world_size(), **config_kwargs)
    if backend == "te" and not torch.cuda.is_available():
        raise ValueError("backend='te' needs a GPU with Transformer Engine; use backend='emulated'")
    kwargs = dict(vp_stage=vp_stage) if vp_stage is not None else {}
    if getattr(config, "num_moe_experts", None):  # MoE: Megatron's block spec, dense and MoE layers
        spec = get_moe_block_spec(config, backend, vp_stage)
    else:
        spec = get_layer_spec(backend, multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)))
    if getattr(config, "mtp_num_layers", None):  # the config's multi-token-prediction layers (never with MoE: refused)
        kwargs["mtp_block_spec"] = get_mtp_block_spec(config, spec, backend, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        **kwargs,
    )


def build_model_chunks(shape: ModelShape, *, config=None, backend: str = "emulated",
                       **config_kwargs) -> list:
    """Every model chunk of this rank: one, or `vpp` with virtual pipelining."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build_gpt_model(shape, config=config, backend=backend, **config_kwargs)]
    return [build_gpt_model(shape, config=config, backend=backend, vp_stage=i, **config_kwargs)
            for i in range(vpp)]
