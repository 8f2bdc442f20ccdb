"""The Llama-like model builder: layout validation and what it builds."""

import pytest
import torch

from snip_megatron.megatron.model import build_gpt_model, make_transformer_config, validate_layout
from snip_megatron.megatron.smoke import SMOKE_SHAPE
from snip_megatron.shapes import get_shape


@pytest.mark.parametrize("kwargs, field", [
    (dict(tp=3), "num_attention_heads"),
    (dict(tp=4), "num_query_groups"),
    (dict(pp=3), "num_layers"),
    (dict(pp=2, vpp=4), "num_layers"),
    (dict(activation="swish-ish"), "activation"),
    (dict(tp=0), "tensor_model_parallel_size"),
])
def test_bad_layout_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        validate_layout(SMOKE_SHAPE, **kwargs)


def test_bad_layout_raises_from_config_builder():
    with pytest.raises(ValueError, match="num_attention_heads"):
        make_transformer_config(SMOKE_SHAPE, tp=3)


def test_70b_layout_is_valid():
    validate_layout(get_shape("llama_70b"), tp=8, pp=8, vpp=5)


def test_builds_llama_like_model(megatron_single):
    model = build_gpt_model(SMOKE_SHAPE, backend="local")
    cfg = model.config
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.num_query_groups == 2
    assert model.position_embedding_type == "rope"
    assert not model.share_embeddings_and_output_weights
    assert model.output_layer.weight.data_ptr() != model.embedding.word_embeddings.weight.data_ptr()
    layer = model.decoder.layers[0]
    h, groups, head = SMOKE_SHAPE.hidden_size, 2, SMOKE_SHAPE.head_dim
    assert tuple(layer.self_attention.linear_qkv.weight.shape) == ((4 + 2 * groups) * head, h)
    assert tuple(layer.mlp.linear_fc1.weight.shape) == (2 * SMOKE_SHAPE.ffn_hidden_size, h)
    assert "RMSNorm" in type(layer.input_layernorm).__name__ or \
        isinstance(getattr(layer.input_layernorm, "module", layer.input_layernorm), torch.nn.RMSNorm) or \
        "rms" in repr(layer.input_layernorm).lower()
    assert sum(p.numel() for p in model.parameters()) > 0


def test_platform_flags_switch_fused_kernels_off_wherever_te_is_missing():
    from snip_megatron.megatron.model import CPU_SAFE_FLAGS, FUSED_KERNELS_OFF, platform_flags

    assert platform_flags(cuda=False, te=False) == CPU_SAFE_FLAGS and CPU_SAFE_FLAGS["use_cpu_initialization"]
    gpu_no_te = platform_flags(cuda=True, te=False)
    assert gpu_no_te == FUSED_KERNELS_OFF and "use_cpu_initialization" not in gpu_no_te
    assert not any(gpu_no_te.values())
    assert platform_flags(cuda=True, te=True) == {}  # Megatron's own defaults with TE
