"""Checks of the TE test double on its own (no Megatron): recipes, autocast rules, numerics, refusals.

    PYTHONPATH=<repo>:<repo>/tests/te_double python tests/te/double_checks.py --out FILE

Run with the NVTE_* recipe variables unset (TE's defaults). tests/te/test_te_double.py runs it in a
subprocess and asserts every check passed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import run_checks  # noqa: E402

S, B, K, M = 32, 2, 64, 96  # tokens x batch x in-features -> out-features


def _data(seed=0, k=K, m=M):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, k, generator=g)
    gy = torch.randn(S, B, m, generator=g)
    w = torch.randn(m, k, generator=g) * 0.1
    return x, w, gy


def _linear(w, **kwargs):
    import transformer_engine.pytorch as te

    layer = te.Linear(w.shape[1], w.shape[0], bias=False, **kwargs)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer


def _run(module, x, gy, context=contextlib.nullcontext, weight=None):
    """(y, dX, dW) of one forward/backward of `module` under `context()`."""
    x = x.clone().requires_grad_()
    with context():
        y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(gy)
    weight = module.weight if weight is None else weight
    return y.detach(), x.grad, weight.grad


def _emulated(x, w, gy, fmt: str, generator_state=None):
    """(y, dX, dW) of our own `quantized_linear` for recipe name `fmt`."""
    from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear
    from snip_megatron.formats import FormatSpec

    precision = "fp4" if fmt == "nvfp4" else "fp8"
    spec = FormatSpec.for_precision(precision, **({"fp4_recipe": fmt} if precision == "fp4"
                                                  else {"fp8_recipe": fmt}))
    generator = torch.Generator()
    if generator_state is not None:
        generator.set_state(generator_state)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = quantized_linear(x, w, None, spec, QuantRuntime(generator=generator))
    y.backward(gy)
    return y.detach(), x.grad, w.grad


def _fp32_block_scaling():
    """TE's Float8BlockScaling with FP32 scales, set the way TE reads them (per-operand QParams)."""
    from transformer_engine.common.recipe import Float8BlockScaling, QParams

    recipe = Float8BlockScaling()
    recipe.fp8_quant_fwd_inp = recipe.fp8_quant_fwd_weight = recipe.fp8_quant_bwd_grad = \
        QParams(power_2_scale=False)
    return recipe


def _recipes():
    from transformer_engine.common.recipe import (Float8CurrentScaling, Format, MXFP8BlockScaling,
                                                  NVFP4BlockScaling)

    return {"blockwise": _fp32_block_scaling(),
            "tensorwise": Float8CurrentScaling(fp8_format=Format.HYBRID),
            "mxfp8": MXFP8BlockScaling(fp8_format=Format.E4M3), "nvfp4": NVFP4BlockScaling()}


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def check_version_from_metadata():
    from importlib import metadata

    import transformer_engine

    assert metadata.version("transformer-engine") == "2.14.0"
    assert transformer_engine.__version__ == "2.14.0"
    assert os.path.join("tests", "te_double") in transformer_engine.__file__


def check_recipe_defaults_follow_te_2_14():
    from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                                  Float8CurrentScaling, Format, MXFP8BlockScaling,
                                                  NVFP4BlockScaling)

    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in os.environ
    block = Float8BlockScaling()
    assert block.fp8_format == Format.E4M3 and not block.use_f32_scales
    assert block.fp8_quant_fwd_inp.power_2_scale and block.fp8_quant_bwd_grad.power_2_scale
    assert (block.x_block_scaling_dim, block.w_block_scaling_dim,
            block.grad_block_scaling_dim) == (1, 2, 1)
    assert Float8CurrentScaling().fp8_format == Format.HYBRID
    assert MXFP8BlockScaling().fp8_format == Format.E4M3
    assert DelayedScaling().fp8_format == Format.HYBRID
    nv = NVFP4BlockScaling()
    assert nv.fp4_quant_fwd_inp.random_hadamard_transform and not nv.fp4_quant_fwd_inp.stochastic_rounding
    assert nv.fp4_quant_fwd_weight.fp4_2d_quantization and not nv.fp4_quant_fwd_weight.random_hadamard_transform
    assert nv.fp4_quant_bwd_grad.stochastic_rounding and nv.fp4_quant_bwd_grad.random_hadamard_transform
    assert not NVFP4BlockScaling(disable_rht=True).fp4_quant_bwd_grad.random_hadamard_transform
    # Value equality: Megatron builds a new recipe object per forward, TE compares them with ==.
    assert Float8CurrentScaling() == Float8CurrentScaling()
    assert Float8CurrentScaling(fp8_format=Format.E4M3) != Float8CurrentScaling()
    assert MXFP8BlockScaling() != Float8BlockScaling()
    for cls in (Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, DelayedScaling):
        try:
            cls(fp8_format=Format.E5M2)
        except AssertionError:
            continue
        raise AssertionError(f"{cls.__name__} accepted pure E5M2")
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344


def check_autocast_nesting_and_restore():
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    outer, inner = MXFP8BlockScaling(), NVFP4BlockScaling()
    assert not state.is_fp8_enabled()
    with te.autocast(enabled=True, recipe=outer, amax_reduction_group="g-outer"):
        assert state.is_fp8_enabled() and state.get_fp8_recipe() is outer
        assert state.get_fp8_group() == "g-outer"
        with te.autocast(enabled=True, recipe=inner):
            assert state.get_fp8_recipe() is inner and state.get_fp8_group() is None
        with te.autocast(enabled=False):
            assert not state.is_fp8_enabled()
        assert state.is_fp8_enabled() and state.get_fp8_recipe() is outer
        try:
            with te.fp8_autocast(enabled=False):
                raise KeyError("leave the block by an exception")
        except KeyError:
            pass
        assert state.is_fp8_enabled() and state.get_fp8_recipe() is outer
        assert state.AUTOCAST_DEPTH == 1
    assert not state.is_fp8_enabled() and state.FP8_RECIPE is None and state.AUTOCAST_DEPTH == 0
    with te.fp8_autocast(enabled=True, fp8_recipe=None, fp8_group="g"):
        assert isinstance(state.get_fp8_recipe(), DelayedScaling) and state.get_fp8_group() == "g"
        assert state.is_first_fp8_module() and not state.is_first_fp8_module()


def check_linear_runs_our_emulation_per_recipe():
    """Inside an autocast the three GEMMs are exactly our quantized_linear for that recipe;
    an inner autocast overrides the outer one; enabled=False gives the plain GEMM."""
    import transformer_engine.pytorch as te

    x, w, gy = _data()
    recipes = _recipes()
    for fmt, recipe in recipes.items():
        layer = _linear(w)
        state = layer.sr_generator.get_state()
        got = _run(layer, x, gy, lambda: te.autocast(enabled=True, recipe=recipe))
        assert layer.last_run.formats == fmt and layer.last_run.recipe is recipe, layer.last_run
        assert _equal(got, _emulated(x, w, gy, fmt, state)), fmt
        assert not torch.equal(got[0], F.linear(x, w)), f"{fmt} output is not quantized"

    def nested(inner):
        @contextlib.contextmanager
        def ctx():
            with te.autocast(enabled=True, recipe=recipes["mxfp8"]):
                with inner:
                    yield
        return ctx

    layer = _linear(w)
    state = layer.sr_generator.get_state()
    got = _run(layer, x, gy, nested(te.autocast(enabled=True, recipe=recipes["nvfp4"])))
    assert layer.last_run.formats == "nvfp4" and _equal(got, _emulated(x, w, gy, "nvfp4", state))
    layer = _linear(w)
    got = _run(layer, x, gy, nested(te.autocast(enabled=False)))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr, wr).backward(gy)
    assert not layer.last_run.quantized and _equal(got, (F.linear(x, w), xr.grad, wr.grad))
    assert dict(layer.run_counts) == {"high_precision": 1}


def check_unemulated_variants_are_recorded_and_refused():
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling,
                                                  Float8CurrentScaling, Format, MXFP8BlockScaling,
                                                  NVFP4BlockScaling)

    x, w, gy = _data()
    cases = [(Float8BlockScaling(), "power-of-two scales"),
             (Float8BlockScaling(fp8_format=Format.HYBRID), "power-of-two scales"),
             (Float8CurrentScaling(fp8_format=Format.E4M3), "E4M3-only tensorwise"),
             (MXFP8BlockScaling(fp8_format=Format.HYBRID), "MXFP8BlockScaling(fp8_format=HYBRID)"),
             (NVFP4BlockScaling(disable_rht=True), "disable_rht=True"),
             (NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True),
              "disable_stochastic_rounding=True, disable_2d_quantization=True"),
             (DelayedScaling(), "DelayedScaling"), (CustomRecipe(qfactory=print), "CustomRecipe")]
    hybrid_block = _fp32_block_scaling()
    hybrid_block.fp8_format = Format.HYBRID
    cases.append((hybrid_block, "Float8BlockScaling(fp8_format=HYBRID) (E5M2 gradients)"))
    for recipe, words in cases:
        layer = _linear(w)
        try:
            _run(layer, x, gy, lambda: te.autocast(enabled=True, recipe=recipe))
        except NotImplementedError as error:
            assert words in str(error) and "test double" in str(error), (words, error)
            assert layer.last_run.refused == str(error) and layer.last_run.formats is None
            assert layer.last_run.recipe is recipe and dict(layer.run_counts) == {"refused": 1}
            continue
        raise AssertionError(f"{recipe!r} ran although our formats cannot emulate it")


def check_unmodelled_features_are_refused():
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import ops
    from transformer_engine.pytorch.distributed import checkpoint

    attempts = {
        "weight storage": lambda: _build_in(te.quantized_model_init(enabled=True)),
        "fp8_model_init": lambda: _build_in(te.fp8_model_init(enabled=True)),
        "fuse_wgrad_accumulation": lambda: te.Linear(8, 8, fuse_wgrad_accumulation=True),
        "ub_overlap_ag": lambda: te.LayerNormLinear(8, 8, ub_overlap_ag=True),
        "GroupedLinear": lambda: te.GroupedLinear(2, 8, 8),
        "Sequential": lambda: ops.Sequential(),
        "checkpointing": lambda: checkpoint(lambda t: t, torch.ones(1)),
        "context parallelism": lambda: te.DotProductAttention(4, 16, cp_group=object()),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except NotImplementedError as error:
            assert "test double" in str(error), (name, error)
            continue
        raise AssertionError(f"{name} was not refused")
    _build_in(te.quantized_model_init(enabled=False))  # what Megatron opens: allowed


def _build_in(context):
    import transformer_engine.pytorch as te

    with context:
        return te.Linear(8, 8)


def check_same_family_switch_keeps_quantizers_and_class_change_warns():
    """TE 2.14 set_meta_tensor: a new recipe of the same family keeps the quantizers (issue #3157),
    also across a high-precision forward; another class gets new ones and a warning."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling, Format, NVFP4BlockScaling

    x, w, gy = _data()
    hybrid, e4m3 = Float8CurrentScaling(fp8_format=Format.HYBRID), Float8CurrentScaling(fp8_format=Format.E4M3)
    layer = _linear(w)
    first = _run(layer, x, gy, lambda: te.autocast(enabled=True, recipe=hybrid))
    layer.weight.grad = None
    _run(layer, x, gy)  # high precision in between
    layer.weight.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a same-class switch does not warn
        again = _run(layer, x, gy, lambda: te.autocast(enabled=True, recipe=e4m3))
    run = layer.last_run
    assert run.recipe is e4m3 and run.quantizer_recipe.fp8_format == Format.HYBRID, run
    assert run.formats == "tensorwise" and _equal(again, first)
    layer.weight.grad = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = layer.sr_generator.get_state()
        got = _run(layer, x, gy, lambda: te.autocast(enabled=True, recipe=NVFP4BlockScaling()))
    assert any("Recipe type changed from Float8CurrentScaling to NVFP4BlockScaling" in str(c.message)
               for c in caught), [str(c.message) for c in caught]
    assert layer.last_run.formats == "nvfp4" and _equal(got, _emulated(x, w, gy, "nvfp4", state))
    assert dict(layer.run_counts) == {"tensorwise": 2, "high_precision": 1, "nvfp4": 1}
    fresh = _linear(w)  # without held quantizers, E4M3-only current scaling is refused
    try:
        _run(fresh, x, gy, lambda: te.autocast(enabled=True, recipe=e4m3))
    except NotImplementedError:
        return
    raise AssertionError("a fresh module ran E4M3-only current scaling")


def _rms(x, w, eps):
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.to(x32.dtype)).to(x.dtype)


def check_layernorm_linear_norms_and_returns_norm_output():
    import transformer_engine.pytorch as te

    x, w, gy = _data(1)
    eps = 1e-5
    gamma = 1.0 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(2))
    for zero_centered in (False, True):
        layer = te.LayerNormLinear(K, M, eps=eps, bias=True, normalization="RMSNorm",
                                   return_layernorm_output=True, return_bias=True,
                                   zero_centered_gamma=zero_centered)
        assert layer.layer_norm_bias is None
        assert float(layer.layer_norm_weight.detach().sum()) == (0.0 if zero_centered else K)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.layer_norm_weight.copy_(gamma - 1.0 if zero_centered else gamma)
            layer.bias.copy_(torch.arange(M) * 0.01)
        out, bias, ln_out = layer(x)
        assert torch.equal(ln_out, _rms(x, gamma, eps))
        assert torch.equal(out, F.linear(ln_out, w)) and torch.equal(bias, layer.bias)
    # LayerNorm, with the norm output returned next to a quantized GEMM
    layer = te.LayerNormLinear(K, M, bias=False, normalization="LayerNorm",
                               return_layernorm_output=True)
    with torch.no_grad():
        layer.weight.copy_(w)
    state = layer.sr_generator.get_state()
    xg = x.clone().requires_grad_()
    with te.autocast(enabled=True, recipe=_recipes()["nvfp4"]):
        out, ln_out = layer(xg)
    reference_ln = F.layer_norm(x, (K,), eps=1e-5)
    assert torch.allclose(ln_out, reference_ln, atol=1e-6), "LayerNorm"
    assert torch.equal(out, _emulated(ln_out.detach(), w, gy, "nvfp4", state)[0])
    (out * gy).sum().backward()  # gradients reach the input and both norm parameters
    assert xg.grad is not None and layer.layer_norm_bias.grad is not None
    assert layer.layer_norm_weight.sequence_parallel is False


def check_norm_modules():
    import transformer_engine.pytorch as te

    x = torch.randn(5, 3, K, dtype=torch.float64)
    rms = te.RMSNorm(hidden_size=K, eps=1e-6, sequence_parallel=True, params_dtype=torch.float64)
    assert rms.weight.dtype == torch.float64 and rms.weight.sequence_parallel is True
    assert torch.equal(rms(x), _rms(x, rms.weight, 1e-6))
    ln = te.LayerNorm(K, eps=1e-5, zero_centered_gamma=True, dtype=torch.float64)
    with torch.no_grad():
        ln.bias.fill_(0.5)
    assert torch.allclose(ln(x), F.layer_norm(x, (K,), eps=1e-5) + 0.5, atol=1e-12)
    try:
        rms_f32 = te.RMSNorm(K)
        te.LayerNormLinear(K, 8)(x)  # float64 input, float32 parameters
    except TypeError as error:
        assert "Data types for parameters must match" in str(error)
    else:
        raise AssertionError("a dtype mismatch outside autocast was accepted")
    assert rms_f32(x.float()).dtype == torch.float32


def check_dot_product_attention_gqa_causal():
    import transformer_engine.pytorch as te

    g = torch.Generator().manual_seed(3)
    heads, groups, d, s, b = 4, 2, 16, 12, 2
    q = torch.randn(s, b, heads, d, generator=g)
    k = torch.randn(s, b, groups, d, generator=g)
    v = torch.randn(s, b, groups, d, generator=g)
    attn = te.DotProductAttention(heads, d, num_gqa_groups=groups, attn_mask_type="causal")
    out = attn(q, k, v)
    assert out.shape == (s, b, heads * d)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kb, vb = kb.repeat_interleave(heads // groups, 1), vb.repeat_interleave(heads // groups, 1)
    ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).permute(2, 0, 1, 3)
    assert torch.allclose(out, ref.reshape(s, b, -1), atol=1e-5)
    # bshd, and a padding mask (True = masked out) equals an explicit one
    out_bshd = attn(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), qkv_format="bshd")
    assert torch.allclose(out_bshd.transpose(0, 1), out, atol=1e-6)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    padded = attn(q, k, v, attention_mask=causal, attn_mask_type="padding")
    assert torch.allclose(padded, out, atol=1e-6)
    # attention_mask is ignored for 'causal', as in TE
    assert torch.equal(attn(q, k, v, attention_mask=torch.zeros(1, 1, s, s, dtype=torch.bool)), out)
    try:
        attn(q, k, v, qkv_format="thd")
    except NotImplementedError:
        return
    raise AssertionError("thd was not refused")


def check_rng_tracker():
    from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, get_all_rng_states

    tracker = CudaRNGStatesTracker()
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    tracker.add("model-parallel-rng", 7)
    assert torch.equal(torch.get_rng_state(), outside), "add() must not touch the global RNG"
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(first, second), "fork must advance the tracked state"
    assert set(get_all_rng_states()) == {"model-parallel-rng"}
    for bad in (lambda: tracker.add("other", 7), lambda: tracker.add("model-parallel-rng", 8)):
        try:
            bad()
        except RuntimeError:
            continue
        raise AssertionError("a reused seed or name was accepted")
    try:
        with tracker.fork("missing"):
            pass
    except KeyError:
        return
    raise AssertionError("fork of an unknown state was accepted")


if __name__ == "__main__":
    run_checks(dict(globals()), __doc__.split("\n")[0])
