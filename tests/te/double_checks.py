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


def _emulated(x, w, gy, fmt, generator_state=None):
    """(y, dX, dW) of our own `quantized_linear` for `fmt`: a recipe name of `_recipes()`, or a
    (precision, Formats) pair."""
    from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear

    precision, formats = RECIPE_FORMATS[fmt] if isinstance(fmt, str) else fmt
    spec = formats.spec(precision)
    generator = torch.Generator()
    if generator_state is not None:
        generator.set_state(generator_state)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = quantized_linear(x, w, None, spec, QuantRuntime(generator=generator))
    y.backward(gy)
    return y.detach(), x.grad, w.grad


@contextlib.contextmanager
def _capability(text: str):
    """The double's GPU (TE_DOUBLE_COMPUTE_CAPABILITY) for the block's duration."""
    from transformer_engine.pytorch.utils import CAPABILITY_VARIABLE

    old = os.environ.get(CAPABILITY_VARIABLE)
    os.environ[CAPABILITY_VARIABLE] = text
    try:
        yield
    finally:
        if old is None:
            del os.environ[CAPABILITY_VARIABLE]
        else:
            os.environ[CAPABILITY_VARIABLE] = old


def _fp32_block_scaling():
    """TE's Float8BlockScaling with FP32 scales, set the way TE reads them (per-operand QParams)."""
    from transformer_engine.common.recipe import Float8BlockScaling, QParams

    recipe = Float8BlockScaling()
    recipe.fp8_quant_fwd_inp = recipe.fp8_quant_fwd_weight = recipe.fp8_quant_bwd_grad = \
        QParams(power_2_scale=False)
    return recipe


def _formats(precision, **fields):
    from snip_megatron.formats import Formats, Precision

    return Precision.parse(precision), Formats(**fields)


RECIPE_FORMATS = {
    "blockwise": _formats("fp8", fp8_block_scales="pow2"),  # TE's default: power-of-two scales
    "tensorwise": _formats("fp8", fp8_recipe="tensorwise"),
    "mxfp8": _formats("fp8", fp8_recipe="mxfp8"),
    "nvfp4": _formats("fp4"),
}


def _recipes():
    from transformer_engine.common.recipe import (Float8BlockScaling, Float8CurrentScaling, Format,
                                                  MXFP8BlockScaling, NVFP4BlockScaling)

    return {"blockwise": Float8BlockScaling(),
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

    from transformer_engine.pytorch.utils import get_device_compute_capability

    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in os.environ
    assert get_device_compute_capability() == (10, 0)  # the double's default GPU: Blackwell
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
    with _capability("9.0"), te.fp8_autocast(enabled=True, fp8_recipe=None, fp8_group="g"):
        assert isinstance(state.get_fp8_recipe(), DelayedScaling) and state.get_fp8_group() == "g"
        assert state.is_first_fp8_module() and not state.is_first_fp8_module()
    with te.autocast(enabled=True, recipe=None):  # TE's default on Blackwell
        assert isinstance(state.get_fp8_recipe(), MXFP8BlockScaling)


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


def check_variants_run_our_formats_of_them():
    """TE's variants our formats emulate: the double runs exactly Formats(...).spec for each."""
    from transformer_engine.common.recipe import (Float8BlockScaling, Float8CurrentScaling, Format,
                                                  NVFP4BlockScaling)

    x, w, gy = _data(3)
    cases = [(Float8BlockScaling(), _formats("fp8", fp8_block_scales="pow2")),
             (Float8BlockScaling(fp8_format=Format.HYBRID),
              _formats("fp8", fp8_format="hybrid", fp8_block_scales="pow2")),
             (Float8CurrentScaling(fp8_format=Format.E4M3), _formats("fp8", fp8_recipe="tensorwise",
                                                                     fp8_format="e4m3")),
             (NVFP4BlockScaling(disable_stochastic_rounding=True),
              _formats("fp4", fp4_gradient_rounding="nearest"))]
    with _capability("9.0"):  # Hopper runs FP32 block scales
        hybrid_fp32 = _fp32_block_scaling()
        hybrid_fp32.fp8_format = Format.HYBRID
        layer = _linear(w)
        got = _run(layer, x, gy, lambda: te_autocast(hybrid_fp32))
        assert _equal(got, _emulated(x, w, gy, _formats("fp8", fp8_format="hybrid")))
    for recipe, (precision, formats) in cases:
        layer = _linear(w)
        state = layer.sr_generator.get_state()
        got = _run(layer, x, gy, lambda: te_autocast(recipe))
        assert layer.last_run.spec == formats.spec(precision), (recipe, layer.last_run)
        assert _equal(got, _emulated(x, w, gy, (precision, formats), state)), recipe
    # The variants differ from the defaults (the comparisons above are not vacuous).
    assert not _equal(_emulated(x, w, gy, _formats("fp8", fp8_block_scales="pow2")),
                      _emulated(x, w, gy, _formats("fp8")))
    assert not _equal(_emulated(x, w, gy, _formats("fp8", fp8_recipe="tensorwise", fp8_format="e4m3")),
                      _emulated(x, w, gy, _formats("fp8", fp8_recipe="tensorwise")))


def te_autocast(recipe):
    import transformer_engine.pytorch as te

    return te.autocast(enabled=True, recipe=recipe)


def check_custom_recipe_calls_the_factory_per_role_and_runs_the_reference_nvfp4():
    """TE 2.14's qfactory protocol: one call per te.Linear role when a module (re)initialises on
    a CustomRecipe, none while an equal recipe is reused; TE's reference NVFP4 factory runs our
    nvfp4 with nearest gradient rounding (its quantizer has no stochastic rounding)."""
    from transformer_engine.common.recipe import CustomRecipe
    from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import (
        NVFP4QuantizerRef, nvfp4_ref_rht_2d_quantizer_factory)

    calls = []

    def recording(role):
        calls.append(role)
        return nvfp4_ref_rht_2d_quantizer_factory(role)

    x, w, gy = _data(4)
    with _capability("9.0"):  # Hopper: the route Megatron takes for FP4 there
        layer = _linear(w)
        got = _run(layer, x, gy, lambda: te_autocast(CustomRecipe(qfactory=recording)))
        assert calls == ["linear_input", "linear_weight", "linear_output", "linear_grad_output",
                         "linear_grad_input"], calls
        nearest = _formats("fp4", fp4_gradient_rounding="nearest")
        assert layer.last_run.formats == "nvfp4" and layer.last_run.spec == nearest[1].spec("fp4")
        assert _equal(got, _emulated(x, w, gy, nearest))
        assert not _equal(got, _emulated(x, w, gy, _formats("fp8", fp8_block_scales="pow2")))
        layer.weight.grad = None
        _run(layer, x, gy, lambda: te_autocast(CustomRecipe(qfactory=recording)))  # equal recipe
        assert len(calls) == 5 and dict(layer.run_counts) == {"nvfp4": 2}
        quantizers = layer.quantizers
        assert quantizers["linear_output"] is None and quantizers["linear_grad_input"] is None
        assert isinstance(quantizers["linear_weight"], NVFP4QuantizerRef)
        assert quantizers["linear_weight"].quant_tile_shape == (16, 16) and quantizers["linear_input"].with_rht

        def other(role):  # any other factory has no emulation here
            q = nvfp4_ref_rht_2d_quantizer_factory(role)
            if role == "linear_weight":
                q.quant_tile_shape = (1, 16)
            return q

        fresh = _linear(w)
        try:
            _run(fresh, x, gy, lambda: te_autocast(CustomRecipe(qfactory=other)))
        except NotImplementedError as error:
            assert "CustomRecipe with quantizers" in str(error) and fresh.last_run.refused
            return
    raise AssertionError("a custom factory other than TE's reference NVFP4 one ran")


def check_unemulated_variants_are_recorded_and_refused():
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling,
                                                  Float8CurrentScaling, Format, MXFP8BlockScaling,
                                                  NVFP4BlockScaling, QParams)

    x, w, gy = _data()
    pow2_current = Float8CurrentScaling()
    pow2_current.fp8_quant_fwd_inp = pow2_current.fp8_quant_fwd_weight = \
        pow2_current.fp8_quant_bwd_grad = QParams(power_2_scale=True)
    mixed_block = Float8BlockScaling()
    mixed_block.fp8_quant_bwd_grad = QParams(power_2_scale=False)
    epsilon_block = Float8BlockScaling()
    epsilon_block.fp8_quant_fwd_inp = QParams(power_2_scale=True, amax_epsilon=1e-12)
    cases = [(pow2_current, "Float8CurrentScaling with power-of-two scales"),
             (mixed_block, "power-of-two scales on some operands only"),
             (epsilon_block, "amax_epsilon"),
             (Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1), "block dims"),
             (MXFP8BlockScaling(fp8_format=Format.HYBRID), "MXFP8BlockScaling(fp8_format=HYBRID)"),
             (NVFP4BlockScaling(disable_rht=True), "disable_rht=True"),
             (NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True),
              "disable_2d_quantization=True"),
             (DelayedScaling(), "DelayedScaling")]
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


def check_gpu_capability_checks_follow_te():
    """TE 2.14's support checks at autocast entry and its kernels' checks, on the double's GPU."""
    from transformer_engine.common.recipe import (CustomRecipe, Float8BlockScaling, MXFP8BlockScaling,
                                                  NVFP4BlockScaling)
    from transformer_engine.pytorch import quantization as q
    from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import nvfp4_ref_rht_2d_quantizer_factory

    x, w, gy = _data(5)

    def fails(recipe, error):
        layer = _linear(w)
        try:
            _run(layer, x, gy, lambda: te_autocast(recipe))
        except error as e:
            return str(e)
        raise AssertionError(f"{recipe!r} ran on capability {os.environ.get('TE_DOUBLE_COMPUTE_CAPABILITY')}")

    with _capability("9.0"):
        assert q.is_fp8_available() and q.is_fp8_block_scaling_available() and not q.is_nvfp4_available()
        assert "10.0 or higher required for MXFP8" in fails(MXFP8BlockScaling(), RuntimeError)
        assert "NVFP4 kernels need compute capability 10.0" in fails(NVFP4BlockScaling(), RuntimeError)
        _run(_linear(w), x, gy, lambda: te_autocast(Float8BlockScaling()))  # pow2 runs on Hopper
        _run(_linear(w), x, gy, lambda: te_autocast(_fp32_block_scaling()))  # and FP32
        _run(_linear(w), x, gy, lambda: te_autocast(CustomRecipe(qfactory=nvfp4_ref_rht_2d_quantizer_factory)))
    with _capability("10.0"):
        assert "requires using power of two scaling factors" in fails(_fp32_block_scaling(), RuntimeError)
        assert q.is_mxfp8_available() and q.is_nvfp4_available()
    with _capability("12.0"):
        assert "not supported on 12.0+" in fails(MXFP8BlockScaling(), RuntimeError)
        assert type(q.get_default_fp8_recipe()).__name__ == "Float8CurrentScaling"
    with _capability("8.0"):
        assert "requires compute capability 9.0" in fails(Float8BlockScaling(), RuntimeError)
        assert not q.is_fp8_available()


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
    fresh = _linear(w)  # without held quantizers, E4M3-only current scaling runs as asked
    assert not _equal(_run(fresh, x, gy, lambda: te.autocast(enabled=True, recipe=e4m3)), first)
    assert fresh.last_run.spec.dgrad_grad_output.element.value == "e4m3"


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
