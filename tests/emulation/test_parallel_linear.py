"""The Megatron subclasses in one process: BF16 identity, configuration, re-planning."""

import warnings

import pytest
import torch

from snip_megatron.emulation import QuantRuntime, quantized_linear
from snip_megatron.formats import Formats, FormatSpec, Precision
from snip_megatron.formats.sr_noise import SeedStream
from snip_megatron.shapes import ModelShape

SHAPE = ModelShape(num_layers=1, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                   num_query_groups=4, vocab_size=64, seq_length=16)


class _QC:  # Megatron's QuantizationConfig shape: .config dict and .match_input.module_path
    def __init__(self, config, path="decoder.layers.0.mlp.linear_fc1"):
        self.config = config
        self.match_input = type("M", (), {"module_path": path})()


def _pair(dtype=torch.float32):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear, QuantRowParallelLinear
    from snip_megatron.megatron.model import make_transformer_config

    config = make_transformer_config(SHAPE, params_dtype=dtype)
    col_kw = dict(config=config, init_method=config.init_method, bias=True, gather_output=False,
                  skip_bias_add=False)
    row_kw = dict(config=config, init_method=config.init_method, bias=True, input_is_parallel=True,
                  skip_bias_add=False)
    layers = {}
    for name, cls, kw, sizes in (("col", ColumnParallelLinear, col_kw, (128, 256)),
                                 ("qcol", QuantColumnParallelLinear, col_kw, (128, 256)),
                                 ("row", RowParallelLinear, row_kw, (256, 128)),
                                 ("qrow", QuantRowParallelLinear, row_kw, (256, 128))):
        torch.manual_seed(0)
        layers[name] = cls(*sizes, **kw)
        with torch.no_grad():
            layers[name].bias.normal_()
    return layers


def _fwd_bwd(layer, x, gy):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    y, _ = layer(x)
    y.backward(gy)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_path_is_megatrons_layer(megatron_single, dtype):
    layers = _pair(dtype)
    g = torch.Generator().manual_seed(1)
    for ref, ours, k, m in (("col", "qcol", 128, 256), ("row", "qrow", 256, 128)):
        assert torch.equal(layers[ref].weight, layers[ours].weight)
        layers[ours].finish_init(None)
        assert layers[ours].precision is Precision.BF16
        x = torch.randn(16, 2, k, generator=g).to(dtype)
        gy = torch.randn(16, 2, m, generator=g).to(dtype)
        for a, b in zip(_fwd_bwd(layers[ref], x, gy), _fwd_bwd(layers[ours], x, gy)):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("precision,recipe", [("fp8", "blockwise"), ("fp8", "tensorwise"),
                                              ("fp4", "nvfp4"), ("fp4", "mxfp4")])
def test_quantized_forward_is_quantized_linear(megatron_single, precision, recipe):
    layer = _pair()["qcol"]
    key = "fp8_recipe" if precision == "fp8" else "fp4_recipe"
    layer.finish_init(_QC({"precision": precision, key: recipe, "sr_seed": 9}))
    assert layer.format_spec == FormatSpec.for_precision(precision, **{key: recipe})
    g = torch.Generator().manual_seed(2)
    x, gy = torch.randn(16, 2, 128, generator=g), torch.randn(16, 2, 256, generator=g)
    y, gx, gw, gb = _fwd_bwd(layer, x, gy)
    xr = x.clone().requires_grad_()
    wr = layer.weight.detach().clone().requires_grad_()
    br = layer.bias.detach().clone().requires_grad_()
    yr = quantized_linear(xr, wr, br, layer.format_spec,
                          QuantRuntime(generator=SeedStream(9)))
    yr.backward(gy)
    assert torch.equal(y, yr) and torch.equal(gx, xr.grad)
    assert torch.equal(gw, wr.grad) and torch.equal(gb, br.grad)


def test_set_precision_keeps_parameters_and_changes_numerics(megatron_single):
    layer = _pair()["qrow"]
    params = [id(p) for p in layer.parameters()]
    x = torch.randn(8, 2, 256)
    outs = {}
    for p in ("bf16", "fp8", "fp4", "bf16"):
        layer.set_precision(p)
        assert layer.precision is Precision(p)
        outs.setdefault(p, []).append(layer(x)[0].detach())
    assert [id(p) for p in layer.parameters()] == params
    assert torch.equal(outs["bf16"][0], outs["bf16"][1])
    err = {p: float((outs[p][0] - outs["bf16"][0]).norm()) for p in ("fp8", "fp4")}
    assert 0 < err["fp8"] < err["fp4"]
    # No formats keeps the layer's formats.
    layer.set_precision("fp8", Formats(fp8_recipe="mxfp8"))
    layer.set_precision("fp4")
    layer.set_precision("fp8")
    assert layer.format_spec.recipe == "mxfp8"


def test_finish_init_rejects_bad_configs(megatron_single):
    layer = _pair()["qcol"]
    with pytest.raises(ValueError, match="'precision'"):
        layer.finish_init(_QC({"fp8_recipe": "blockwise"}))
    with pytest.raises(ValueError, match="unknown"):
        layer.finish_init(_QC({"precision": "fp8", "format": "x"}))
    with pytest.raises(ValueError, match="bf16, fp8, fp4"):
        layer.finish_init(_QC({"precision": "int4"}))
    with pytest.raises(ValueError, match="nvfp4, mxfp4"):
        layer.finish_init(_QC({"precision": "fp4", "fp4_recipe": "nvfp8"}))
    assert layer.precision is Precision.BF16  # nothing half-applied


@pytest.mark.compat
def test_repr_shows_formats(megatron_single):
    layers = _pair()
    layers["qcol"].set_precision("fp4")
    assert "formats=fp4:nvfp4 fprop=[e2m1 1x16" in repr(layers["qcol"])
    assert repr(layers["qrow"]).count("formats=bf16") == 1


def test_sr_stream_is_dedicated_and_seeded_by_path(megatron_single):
    layers = _pair()
    a, b = layers["qcol"], layers["qrow"]
    a.finish_init(_QC({"precision": "fp4"}, path="decoder.layers.1.mlp.linear_fc1"))
    b.finish_init(_QC({"precision": "fp4"}, path="decoder.layers.1.mlp.linear_fc1"))
    assert a.sr_stream().seed == b.sr_stream().seed
    b.finish_init(_QC({"precision": "fp4"}, path="decoder.layers.1.mlp.linear_fc2"))
    assert a.sr_stream().seed != b.sr_stream().seed
    state = torch.get_rng_state()
    x = torch.randn(8, 2, 128).requires_grad_()
    state = torch.get_rng_state()
    a(x)[0].sum().backward()
    assert torch.equal(torch.get_rng_state(), state)  # training RNG untouched


def test_warns_when_tp_shards_split_blocks(megatron_single, monkeypatch):
    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear
    from snip_megatron.megatron.model import make_transformer_config

    config = make_transformer_config(SHAPE)
    layer = QuantColumnParallelLinear(128, 80, config=config, init_method=config.init_method,
                                      bias=False, gather_output=False, skip_bias_add=True)
    monkeypatch.setattr(type(layer), "_tp_rank_world", lambda self: (0, 2))  # pretend TP=2
    with pytest.warns(UserWarning, match="not a multiple of its block"):
        layer.set_precision("fp8")  # 80 output rows per shard vs 128x128 weight blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.set_precision("fp4")  # 80 = 5 x 16: aligned
        layer.set_precision("fp8", Formats(fp8_recipe="tensorwise"))  # per-tensor: nothing to align


def test_finish_init_again_keeps_the_sr_stream(megatron_single):
    layer = _pair()["qcol"]
    layer.finish_init(_QC({"precision": "fp4", "sr_seed": 3}))
    stream = layer.sr_stream()
    first = stream.next_seed()
    layer.finish_init(_QC({"precision": "fp4", "sr_seed": 3}))
    assert layer.sr_stream() is stream and stream.next_seed() != first
    with pytest.raises(ValueError, match="sr_seed"):
        layer.finish_init(_QC({"precision": "fp8", "sr_seed": "x"}))
    assert layer.precision is Precision.FP4
