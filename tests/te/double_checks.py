"""Checks of the TE test double on its own: recipes, autocast rules, numerics, refusals, and TE's
run-time state (weight workspaces, fused weight-gradient accumulation, the reference NVFP4 tensor
emptied when saved, shape and bias rules, CUDA / cuBLAS gates, version metadata).

    PYTHONPATH=<repo>:<repo>/tests/te_double python tests/te/double_checks.py --out FILE

Run with the NVTE_* recipe variables and TE_DOUBLE_* unset (TE's defaults, SM100, CUDA 13.0).
tests/te/test_te_double.py runs it in a subprocess and asserts every check passed. Three checks start
their own subprocesses: another TE version (a dist-info from te_versions.py), the apex double under
Megatron's local linear, and context-parallel attention on two processes (cp_attention_worker.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import run_checks  # noqa: E402
from snip_vs_double import agree, share_snip_noise  # noqa: E402
from te_versions import ROOT, double_pythonpath, te_version_folder  # noqa: E402

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
def _environ(**values):
    """Environment variables for the block's duration (the double re-reads its GPU and CUDA)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _capability(text: str):
    """The double's GPU (TE_DOUBLE_COMPUTE_CAPABILITY) for the block's duration."""
    return _environ(TE_DOUBLE_COMPUTE_CAPABILITY=text)


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


def _agree(got, want, fmt) -> bool:
    """The double's numbers and SNIP's: bit for bit, or for NVFP4 within a few FP32 ulps
    (snip_vs_double.agree: TE's NVFP4 arithmetic order differs from SNIP's)."""
    return agree(tuple(got), tuple(want), fmt)


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
    """Inside an autocast the double's three GEMMs (its own TE quantizers) give SNIP's
    quantized_linear for that recipe (bit for bit; NVFP4 within a few ulps); an inner autocast
    overrides the outer one; enabled=False gives the plain GEMM."""
    import transformer_engine.pytorch as te

    x, w, gy = _data()
    recipes = _recipes()
    for fmt, recipe in recipes.items():
        layer = _linear(w)
        state = layer.sr_generator.get_state()
        got = _run(layer, x, gy, lambda: te.autocast(enabled=True, recipe=recipe))
        assert layer.last_run.formats == fmt and layer.last_run.recipe is recipe, layer.last_run
        assert _agree(got, _emulated(x, w, gy, fmt, state), fmt), fmt
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
    assert layer.last_run.formats == "nvfp4" and _agree(got, _emulated(x, w, gy, "nvfp4", state), "nvfp4")
    layer = _linear(w)
    got = _run(layer, x, gy, nested(te.autocast(enabled=False)))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr, wr).backward(gy)
    assert not layer.last_run.quantized and _equal(got, (F.linear(x, w), xr.grad, wr.grad))
    assert dict(layer.run_counts) == {"high_precision": 1}


def check_variants_run_our_formats_of_them():
    """TE's variants SNIP's formats emulate: what the double computes for each is what SNIP's
    Formats(...).spec computes (bit for bit; NVFP4 within a few ulps)."""
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
        assert layer.last_run.formats == formats.spec(precision).recipe, (recipe, layer.last_run)
        assert _agree(got, _emulated(x, w, gy, (precision, formats), state), layer.last_run.formats), recipe
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
        assert layer.last_run.formats == "nvfp4" and not layer.last_run.spec.grad_output.stochastic
        assert _agree(got, _emulated(x, w, gy, nearest), "nvfp4")
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
    """TE 2.14's support checks at autocast entry (check_recipe_support's RuntimeError, then
    autocast_enter's asserts: NVFP4 on Hopper is an AssertionError with TE's reason, and the
    double's autocast leaves no state behind) and its kernels' checks, on the double's GPU."""
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
        assert fails(NVFP4BlockScaling(), AssertionError) == \
            "Device compute capability 10.0 or higher required for NVFP4 execution."
        assert not q.FP8GlobalStateManager.is_fp8_enabled() and q.FP8GlobalStateManager.AUTOCAST_DEPTH == 0
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
        "delay_wgrad_compute": lambda: te.Linear(8, 8, delay_wgrad_compute=True),
        "ub_overlap_ag": lambda: te.LayerNormLinear(8, 8, ub_overlap_ag=True),
        "single grouped weight": lambda: te.GroupedLinear(2, 8, 8, single_grouped_weight=True),
        "Sequential": lambda: ops.Sequential(),
        "checkpointing": lambda: checkpoint(lambda t: t, torch.ones(1)),
        "hierarchical context parallelism": lambda: te.DotProductAttention(
            4, 16, cp_group=[object(), object()], cp_comm_type="a2a+p2p"),
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
    assert layer.last_run.formats == "nvfp4" and _agree(got, _emulated(x, w, gy, "nvfp4", state), "nvfp4")
    assert dict(layer.run_counts) == {"tensorwise": 2, "high_precision": 1, "nvfp4": 1}
    fresh = _linear(w)  # without held quantizers, E4M3-only current scaling runs as asked
    assert not _equal(_run(fresh, x, gy, lambda: te.autocast(enabled=True, recipe=e4m3)), first)
    assert fresh.last_run.spec.grad_output.dtype == torch.float8_e4m3fn


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
    assert agree(out, _emulated(ln_out.detach(), w, gy, "nvfp4", state)[0], "nvfp4")
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


def check_context_parallel_attention_equals_the_whole_sequence():
    """Two processes (gloo), CP=2 with cp_comm_type 'p2p' over Megatron's load-balanced split
    (tests/te/cp_attention_worker.py): outputs and dQ, dK, dV equal one process's attention over the
    whole sequence (causal GQA in sbhd, causal in bshd, no mask, MLA's wider K), also with the group
    set after construction and taken away again; Megatron's RoPE holds the positions the double
    masks by; what TE runs differently or not at all is refused."""
    import tempfile

    from tests.distributed import run_distributed

    with tempfile.TemporaryDirectory() as out:
        run_distributed([os.path.join(os.path.dirname(os.path.abspath(__file__)), "cp_attention_worker.py"),
                         "--out", out], nproc=2, timeout=300, env={"PYTHONPATH": double_pythonpath()})
        ranks = [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(2)]
    for r in ranks:
        assert len(r["worst"]) == 12 and all(d < 1e-5 for d in r["worst"].values()), r["worst"]
        assert r["rope"] is True
        refused = r["refusals"]
        assert all(refused[name].startswith("NotImplementedError") and "test double" in refused[name] for name in
                   ("a2a", "all_gather", "a2a+p2p", "padding_causal", "causal_bottom_right", "thd",
                    "causal cross-attention")), refused
        assert refused["not a group"].startswith("AssertionError: cp_group must be"), refused  # TE's own
        assert refused["odd local length"] == "AssertionError: Sequence length per GPU needs to be divisible by 2!"
        assert refused["other ranks"].startswith("ValueError"), refused


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


# --- TE's run-time state -------------------------------------------------------------------


def _step(layer, x, gy, recipe=None, backward=True, **forward_kwargs):
    """(y, dX) of one forward of `layer` (under `recipe`'s autocast, or in high precision) and,
    unless backward=False, its backward; with backward=False the output, still attached."""
    import transformer_engine.pytorch as te

    x = x.clone().requires_grad_()
    context = contextlib.nullcontext() if recipe is None else te.autocast(enabled=True, recipe=recipe)
    with context:
        y = layer(x, **forward_kwargs)
    y = y[0] if isinstance(y, tuple) else y
    if not backward:
        return y
    y.backward(gy)
    return y.detach(), x.grad


def _set_weight(layer, w):
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.weight.grad = None


def _expect(error, run, words: str) -> str:
    """The message of the `error` that `run()` raises; it must contain `words`."""
    try:
        run()
    except error as e:
        assert words in str(e), (words, str(e))
        return str(e)
    raise AssertionError(f"no {error.__name__} ({words})")


def check_weight_workspace_follows_is_first_microbatch():
    """TE's cached quantized weight (linear.py:253-281, base.py:1395-1522): is_first_microbatch=True
    creates it, then re-quantizes it from the live weight; False reuses it as it was (stale after a
    weight change); None bypasses the cache. The fprop and dgrad GEMMs read it, the weight gradient
    reaches the live weight. LayerNormLinear keeps it the same way."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    x, w1, gy = _data(6)
    w2, w3 = w1.flip(0), 0.5 * w1
    recipe = Float8BlockScaling()
    layer = _linear(w1)
    for first, weight, how, computed_on in ((True, w1, "created", w1), (False, w2, "reused", w1),
                                            (True, w2, "refreshed", w2), (None, w3, "none", w3),
                                            (False, w3, "reused", w2)):
        _set_weight(layer, weight)
        got = _step(layer, x, gy, recipe, is_first_microbatch=first) + (layer.weight.grad,)
        assert layer.last_run.weight_workspace == how, (first, layer.last_run)
        assert _equal(got, _emulated(x, computed_on, gy, "blockwise")), (first, how)
        if computed_on is not weight:  # not vacuous: the live weight would give another output
            assert not torch.equal(got[0], _emulated(x, weight, gy, "blockwise")[0])
    assert torch.equal(layer._fp8_workspaces["weight"].values, w2)
    norm_linear = te.LayerNormLinear(K, M, bias=False, normalization="RMSNorm")
    hows = []
    for first in (True, False, True, None, False):
        _step(norm_linear, x, gy, recipe, is_first_microbatch=first)
        hows.append(norm_linear.last_run.weight_workspace)
    assert hows == ["created", "reused", "refreshed", "none", "reused"], hows
    _step(norm_linear, x, gy, is_first_microbatch=True)  # high precision: no workspace
    assert norm_linear.last_run.weight_workspace == "none" and not norm_linear.last_run.quantized


def check_workspaces_cleared_on_recipe_class_change_only():
    """TE 2.14 init_fp8_metadata: a recipe class change clears the workspaces (base.py:1060-1070); a
    same-class recipe and a high-precision forward in between keep them (a stale cached weight
    survives both). A workspace made without column-wise data (no grad) is made again when a
    forward needs it for MXFP8 (base.py:1453-1477), not for blockwise FP8."""
    from transformer_engine.common.recipe import Float8BlockScaling, Format, MXFP8BlockScaling

    x, w1, gy = _data(7)
    w2 = w1.flip(1)
    layer = _linear(w1)
    _step(layer, x, gy, Float8BlockScaling(), is_first_microbatch=True)
    _set_weight(layer, w2)
    _step(layer, x, gy, None, is_first_microbatch=False)  # BF16 forward in between
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Recipe type changed"
        got = _step(layer, x, gy, Float8BlockScaling(fp8_format=Format.HYBRID), is_first_microbatch=False)
    assert layer.last_run.weight_workspace == "reused"
    assert _equal(got, _emulated(x, w1, gy, "blockwise")[:2])  # the quantizers and the weight of step 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _step(layer, x, gy, _recipes()["tensorwise"], is_first_microbatch=False)
    assert any("Recipe type changed" in str(c.message) for c in caught)
    assert layer.last_run.weight_workspace == "created" and _equal(got, _emulated(x, w2, gy, "tensorwise")[:2])
    for recipe, how in ((MXFP8BlockScaling(), "created"), (Float8BlockScaling(), "reused")):
        layer = _linear(w1)
        with torch.no_grad():
            _step(layer, x, gy, recipe, backward=False, is_first_microbatch=True)
        assert layer._fp8_workspaces["weight"].columnwise is False
        _set_weight(layer, w2)
        _step(layer, x, gy, recipe, is_first_microbatch=False)
        assert layer.last_run.weight_workspace == how, (recipe, layer.last_run)


def _fused(w, **kwargs):
    layer = _linear(w, fuse_wgrad_accumulation=True, **kwargs)
    layer.weight.main_grad = torch.full(layer.weight.shape, 7.0, dtype=torch.float32)
    layer.weight.grad_added_to_main_grad = False
    return layer


def check_fused_wgrad_accumulates_into_main_grad():
    """fuse_wgrad_accumulation=True (linear.py:832-867, 943-964): the wgrad GEMM writes main_grad in
    FP32, overwriting it when is_first_microbatch is True or the weight has overwrite_main_grad,
    adding otherwise; with grad_added_to_main_grad on the weight (Megatron's DDP) TE sets it and
    returns its dummy wgrad (zeros under zero_out_wgrad), without it None. Built-in recipe and high
    precision alike; LayerNormLinear reads overwrite_main_grad on its weight operand (in FP8 the
    workspace, so it accumulates)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    batches = [_data(seed) for seed in (8, 9, 10, 11, 12)]
    w = batches[0][1]
    for recipe in (Float8BlockScaling(), None):
        layer = _fused(w)
        weight = layer.weight
        expected = None
        for n, ((x, _, gy), first) in enumerate(zip(batches, (True, False, None, False, False))):
            if n == 3:
                weight.zero_out_wgrad = True
            if n == 4:
                del weight.grad_added_to_main_grad
            weight.grad = None
            _step(layer, x, gy, recipe, is_first_microbatch=first)
            dw = (_emulated(x, w, gy, "blockwise")[2] if recipe is not None
                  else gy.reshape(-1, M).t() @ x.reshape(-1, K))
            expected = dw if first else expected + dw
            assert torch.equal(weight.main_grad, expected), (recipe, n)
            if n < 4:
                assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape
                assert weight.grad.dtype == weight.dtype
            if n == 3:
                assert not weight.grad.any()  # zero_out_wgrad: TE's dummy, zeroed
            if n == 4:
                assert weight.grad is None  # fused, and no grad_added_to_main_grad: wgrad None
        weight.overwrite_main_grad = True
        x, _, gy = batches[1]
        _step(layer, x, gy, recipe, is_first_microbatch=False)
        assert torch.equal(weight.main_grad, _emulated(x, w, gy, "blockwise")[2] if recipe is not None
                           else gy.reshape(-1, M).t() @ x.reshape(-1, K))
    # high precision with BF16 weights: dW reaches main_grad in FP32, not rounded to BF16 first
    x, _, gy = batches[2]
    layer = _fused(w.bfloat16(), params_dtype=torch.bfloat16)
    _step(layer, x.bfloat16(), gy.bfloat16(), None, is_first_microbatch=True)
    assert torch.equal(layer.weight.main_grad, gy.bfloat16().float().reshape(-1, M).t()
                       @ x.bfloat16().float().reshape(-1, K))
    # LayerNormLinear with overwrite_main_grad: FP8 accumulates, high precision overwrites
    for recipe, accumulates in ((Float8BlockScaling(), True), (None, False)):
        twins = [te.LayerNormLinear(K, M, bias=False, normalization="RMSNorm",
                                    fuse_wgrad_accumulation=fuse) for fuse in (True, False)]
        twins[1].load_state_dict(twins[0].state_dict())
        twins[0].weight.main_grad = torch.ones(M, K)
        twins[0].weight.overwrite_main_grad = True
        for twin in twins:
            _step(twin, x, gy, recipe, is_first_microbatch=False)
        dw = twins[1].weight.grad
        assert twins[0].weight.grad is None  # no grad_added_to_main_grad attribute: wgrad None
        assert torch.equal(twins[0].weight.main_grad, 1.0 + dw if accumulates else dw), recipe


def check_grouped_linear_runs_each_split_as_a_linear_and_refuses_unaligned_splits():
    """GroupedLinear (grouped_linear.py): weight0..weight{n-1}; forward(inp, m_splits,
    is_first_microbatch) runs split i as a Linear of weight<i> under the module's one recipe (each
    GEMM quantized on its own: our emulation per split), caches a workspace per GEMM ("weight<i>"),
    routes each wgrad into weight<i>.main_grad under fusion (an empty split: zeros, no quantizer),
    and refuses splits TE's kernels cannot take: FP8 rows % 16, MXFP8 % 32, NVFP4 % 32, a
    CustomRecipe at all; NVFP4 on an inner dim not a multiple of 128 runs with TE's warning."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import CustomRecipe, Float8BlockScaling
    from transformer_engine.pytorch.custom_recipes import quantization_nvfp4

    k, m, splits = 128, 64, [32, 0, 64]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(splits), k, generator=g)
    gy = torch.randn(sum(splits), m, generator=g)
    ws = [torch.randn(m, k, generator=g) * 0.1 for _ in splits]
    recipes = _recipes()
    for fmt in ("blockwise", "tensorwise", "mxfp8", "nvfp4"):
        layer = te.GroupedLinear(len(splits), k, m, bias=False)
        assert [n for n, _ in layer.named_parameters()] == ["weight0", "weight1", "weight2"]
        with torch.no_grad():
            for i, w in enumerate(ws):
                getattr(layer, f"weight{i}").copy_(w)
        y, dx = _step(layer, x, gy, recipes[fmt], m_splits=splits)
        assert layer.last_run.formats == fmt and layer.last_splits == splits
        want_y, want_dx = [], []
        for i, (xi, gi) in enumerate(zip(x.split(splits), gy.split(splits))):
            if not xi.shape[0]:
                want_y.append(xi.new_empty((0, m)))
                want_dx.append(xi.new_empty((0, k)))
                assert not layer.weight1.grad.any()  # no rows, zero weight gradient
                continue
            yi, dxi, dwi = _emulated(xi, ws[i], gi, fmt)
            want_y.append(yi)
            want_dx.append(dxi)
            if fmt != "nvfp4":  # NVFP4 rounds gradients stochastically from the module's one stream
                assert torch.equal(getattr(layer, f"weight{i}").grad, dwi), (fmt, i)
        assert agree(y, torch.cat(want_y), fmt), fmt
        assert not torch.equal(y, torch.cat([xi @ w.t() for xi, w in zip(x.split(splits), ws)])), fmt
        if fmt != "nvfp4":
            assert torch.equal(dx, torch.cat(want_dx)), fmt
    # fused wgrad per GEMM, workspaces per GEMM
    layer = te.GroupedLinear(2, k, m, bias=False, fuse_wgrad_accumulation=True)
    for w in (layer.weight0, layer.weight1):
        w.main_grad = torch.full(w.shape, 7.0)
        w.grad_added_to_main_grad = False
    x2, gy2 = x[:64], gy[:64]
    _step(layer, x2, gy2, Float8BlockScaling(), m_splits=[16, 48], is_first_microbatch=True)
    assert layer.gemm_runs == ["created", "created"] and set(layer._fp8_workspaces) == {"weight0", "weight1"}
    assert layer.weight0.grad_added_to_main_grad and layer.weight1.grad_added_to_main_grad
    first = layer.weight1.main_grad.clone()
    _step(layer, x2, gy2, Float8BlockScaling(), m_splits=[16, 48], is_first_microbatch=False)
    assert layer.gemm_runs == ["reused", "reused"] and torch.equal(layer.weight1.main_grad, 2 * first)
    # an empty split's weight workspace is taken too (TE's forward takes every GEMM's), so it is
    # cached from the first micro-batch and reused after, as the others are
    layer = te.GroupedLinear(2, k, m, bias=False)
    _step(layer, x2, gy2, Float8BlockScaling(), m_splits=[0, 64], is_first_microbatch=True)
    assert layer.gemm_runs == ["created", "created"] and set(layer._fp8_workspaces) == {"weight0", "weight1"}
    _step(layer, x2, gy2, Float8BlockScaling(), m_splits=[64, 0], is_first_microbatch=False)
    assert layer.gemm_runs == ["reused", "reused"] and layer.last_run.weight_workspace == "reused"
    # TE's refusals of unaligned splits (and of a CustomRecipe)
    refusals = {"blockwise": ([8, 56], "not a multiple of 16"), "tensorwise": ([8, 56], "multiple of 16"),
                "mxfp8": ([16, 48], "not a multiple of 32"), "nvfp4": ([16, 48], "not a multiple of 32")}
    for fmt, (bad, text) in refusals.items():
        layer = te.GroupedLinear(2, k, m, bias=False)
        try:
            _step(layer, x2, gy2, recipes[fmt], m_splits=bad)
        except RuntimeError as error:
            assert text in str(error) and layer.last_run.refused, (fmt, error)
        else:
            raise AssertionError(f"{fmt} took splits {bad}")
        _step(te.GroupedLinear(2, k, m, bias=False), x2, gy2, recipes[fmt], m_splits=[32, 32])
    # NVFP4 on an inner dim not a multiple of 128: TE warns and quantizes each split on its own
    # (csrc/extensions/cast.cpp:1425-1437): each split computes as a linear of its own
    narrow = te.GroupedLinear(2, 64, m, bias=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, _ = _step(narrow, x2[:, :64], gy2, recipes["nvfp4"], m_splits=[32, 32])
    assert any("Unfused NVFP4 quantization fallback" in str(w.message) for w in caught), caught
    assert narrow.last_run.formats == "nvfp4"
    want = [_emulated(xi, getattr(narrow, f"weight{i}").detach(), gi, "nvfp4")[0]
            for i, (xi, gi) in enumerate(zip(x2[:, :64].split([32, 32]), gy2.split([32, 32])))]
    assert agree(y, torch.cat(want), "nvfp4")  # TE's NVFP4 arithmetic order (snip_vs_double)
    try:
        _step(narrow, x2[:, :64], gy2, CustomRecipe(qfactory=quantization_nvfp4.nvfp4_ref_rht_2d_quantizer_factory),
              m_splits=[32, 32])
    except RuntimeError as error:
        assert "Unexpected type for quantizer" in str(error), error
    else:
        raise AssertionError("CustomRecipe was not refused")
    _step(layer, x2, gy2, None, m_splits=[8, 56])  # high precision: any split
    # extra state: empty unless it ran quantized, then the recipe (Megatron splits it per expert)
    assert te.GroupedLinear(2, 8, 8).get_extra_state().numel() == 0
    layer = te.GroupedLinear(2, k, m, bias=False)
    _step(layer, x2, gy2, Float8BlockScaling(), m_splits=[32, 32])
    twin = te.GroupedLinear(2, k, m, bias=False)
    twin.set_extra_state(layer.get_extra_state())
    assert isinstance(twin.fp8_meta["recipe"], Float8BlockScaling)


def check_custom_recipe_gemm_drops_wgrad_under_fusion():
    """A CustomRecipe's GEMM ignores `out` / `accumulate` (custom_recipes/gemm.py:19-31, 137-148):
    with TE's reference NVFP4 factory and fuse_wgrad_accumulation=True the weight gradient is
    computed and dropped, main_grad stays as it was, and TE still reports it added (dummy wgrad,
    grad_added_to_main_grad). Without fusion the weight gradient arrives."""
    from transformer_engine.common.recipe import CustomRecipe
    from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import nvfp4_ref_rht_2d_quantizer_factory

    x, w, gy = _data(13)
    nearest = _formats("fp4", fp4_gradient_rounding="nearest")
    recipe = CustomRecipe(qfactory=nvfp4_ref_rht_2d_quantizer_factory)
    with _capability("9.0"):
        layer = _fused(w)
        for first in (True, False):
            got = _step(layer, x, gy, recipe, is_first_microbatch=first)
            assert _agree(got, _emulated(x, w, gy, nearest)[:2], "nvfp4")  # forward and dgrad as usual
            assert torch.equal(layer.weight.main_grad, torch.full((M, K), 7.0))
            assert layer.weight.grad_added_to_main_grad and layer.weight.grad.shape == (M, K)
        plain = _linear(w)
        _step(plain, x, gy, recipe, is_first_microbatch=True)
        assert agree(plain.weight.grad, _emulated(x, w, gy, nearest)[2], "nvfp4")


def check_reference_workspace_is_emptied_until_its_backward():
    """TE's reference NVFP4 tensor is emptied when a forward saves it (quantization_nvfp4.py:237-246)
    and refilled by that forward's backward: a second forward reusing the cached one before the
    first backward (pipeline warm-up) raises TE's RuntimeError; with is_first_microbatch None or
    True it passes, as after the backward, under no_grad, or with a frozen weight whose dgrad
    backward ran. Built-in recipes' workspaces are never emptied."""
    from transformer_engine.common.recipe import (CustomRecipe, Float8BlockScaling, MXFP8BlockScaling,
                                                  NVFP4BlockScaling)
    from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import nvfp4_ref_rht_2d_quantizer_factory

    reference = CustomRecipe(qfactory=nvfp4_ref_rht_2d_quantizer_factory)
    (x1, w, gy1), (x2, _, gy2) = _data(14), _data(15)
    nearest = _formats("fp4", fp4_gradient_rounding="nearest")
    with _capability("9.0"):
        layer = _linear(w)
        y1 = _step(layer, x1, gy1, reference, backward=False, is_first_microbatch=True)
        _expect(RuntimeError, lambda: _step(layer, x2, gy2, reference, is_first_microbatch=False),
                "Cannot generate FP4 data, even from FP4 data transpose")
        assert layer.last_run.weight_workspace == "reused"
        y1.backward(gy1)  # refills the cached tensor
        got = _step(layer, x2, gy2, reference, is_first_microbatch=False)
        assert _agree(got, _emulated(x2, w, gy2, nearest)[:2], "nvfp4")
        for second in (None, True):
            layer = _linear(w)
            y1 = _step(layer, x1, gy1, reference, backward=False, is_first_microbatch=True)
            y2 = _step(layer, x2, gy2, reference, backward=False, is_first_microbatch=second)
            y2.backward(gy2)
            y1.backward(gy1)
        layer = _linear(w)
        with torch.no_grad():  # nothing saved for backward: nothing emptied
            with te_autocast(reference):
                layer(x1, is_first_microbatch=True)
                layer(x2, is_first_microbatch=False)
        layer.weight.requires_grad_(False)
        _step(layer, x1, gy1, reference, is_first_microbatch=True)  # dgrad only; still refills
        _step(layer, x2, gy2, reference, is_first_microbatch=False)
        for recipe in (Float8BlockScaling(),):
            layer = _linear(w)
            ys = [_step(layer, x, gy1, recipe, backward=False, is_first_microbatch=first)
                  for x, first in ((x1, True), (x2, False))]
            for y in reversed(ys):
                y.backward(gy1)
    for recipe in (MXFP8BlockScaling(), NVFP4BlockScaling()):  # SM100
        layer = _linear(w)
        ys = [_step(layer, x, gy1, recipe, backward=False, is_first_microbatch=first)
              for x, first in ((x1, True), (x2, False))]
        assert layer.last_run.weight_workspace == "reused"
        for y in reversed(ys):
            y.backward(gy1)


def check_shape_and_bias_refusals():
    """TE's refusals of shapes and biases in a quantized linear: its FP8 shape assert on the input
    and the weight (utils.py:479-489, ValueError), MXFP8's and NVFP4's quantizer dims
    (csrc/quantizer.cpp, RuntimeError), the reference NVFP4 GEMM's bias and K % 32 rules and
    its Hadamard transform's token count (ValueError; fprop checks in forward, dgrad / wgrad in
    backward), and cuBLAS's FP8 GEMMs' K % 16 (RuntimeError in backward). High precision takes
    every shape."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import (CustomRecipe, Float8BlockScaling, Float8CurrentScaling,
                                                  MXFP8BlockScaling, NVFP4BlockScaling)
    from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import nvfp4_ref_rht_2d_quantizer_factory

    g = torch.Generator().manual_seed(16)

    def attempt(recipe, tokens, k, m, **kwargs):
        layer = te.Linear(k, m, bias=False, **kwargs) if "bias" not in kwargs else te.Linear(k, m, **kwargs)
        x = torch.randn(tokens // 2, 2, k, generator=g)
        gy = torch.randn(tokens // 2, 2, m, generator=g)
        return layer, lambda: _step(layer, x, gy, recipe)

    fp8 = "FP8 execution requires the product of all dimensions except the last to be divisible by 8"
    for tokens, k, m in ((12, 64, 96), (64, 24, 96), (64, 64, 12)):  # odd tokens, in-, out-features
        layer, run = attempt(Float8BlockScaling(), tokens, k, m)
        message = _expect(ValueError, run, fp8)
        assert layer.last_run.refused == message and layer.last_run.label == "refused"
        attempt(None, tokens, k, m)[1]()  # high precision runs
    assert "dims=[12, 64]" in _expect(ValueError, attempt(Float8BlockScaling(), 64, 64, 12)[1], fp8)
    assert "dims=[6, 2, 64]" in _expect(ValueError, attempt(Float8BlockScaling(), 12, 64, 96)[1], fp8)
    _expect(RuntimeError, attempt(MXFP8BlockScaling(), 16, 64, 96)[1],
            "MXFP8 requires tensor dims that are divisible by 32 (got shape=(8,2,64))")
    _expect(RuntimeError, attempt(NVFP4BlockScaling(), 64, 64, 24)[1],
            "First dim for NVFP4 must be divisible by 16 (got shape=(24,64))")
    reference = CustomRecipe(qfactory=nvfp4_ref_rht_2d_quantizer_factory)
    with _capability("9.0"):
        _expect(ValueError, attempt(reference, 64, 64, 96, bias=True)[1],
                "Bias is not supported in NVFP4QuantizerRef.qgemm")
        attempt(reference, 64, 64, 96, bias=True, return_bias=True)[1]()  # the bias is not in the GEMM
        attempt(reference, 64, 64, 96, bias=True, parallel_mode="row")[1]()  # added after the GEMM
        _expect(ValueError, attempt(reference, 64, 48, 96)[1], "K dimension must be divisible by 32, got K=48")
        _expect(ValueError, attempt(reference, 40, 64, 96)[1],
                "Inner dimension 40 must be divisible by hadamard dimension 16")
        for tokens, m in ((48, 96), (64, 48)):  # wgrad K = tokens, dgrad K = out-features
            layer, _ = attempt(reference, tokens, 64, m)
            x = torch.randn(tokens, 64, generator=g, requires_grad=True)
            with te_autocast(reference):
                y = layer(x)  # the forward passes
            _expect(ValueError, lambda: y.backward(torch.randn(tokens, m, generator=g)),
                    "K dimension must be divisible by 32, got K=48")
    # cuBLAS's FP8 GEMMs: K % 16 (common/gemm/cublaslt_gemm.cu:158-162, 207-214, 250-254, 293-300).
    # 24 tokens and 40 out-features pass TE's assert (% 8) and the forward; wgrad (K = tokens) and
    # dgrad (K = out-features) stop in the backward.
    for recipe, words in ((Float8BlockScaling(), "Leading dimension requirement on NVTE_BLOCK_SCALING GEMM"),
                          (Float8CurrentScaling(), "Leading dimension requirement on A for FP8 GEMM")):
        for tokens, m, k_value in ((24, 96, 24), (64, 40, 40)):
            layer, _ = attempt(recipe, tokens, 64, m)
            x = torch.randn(tokens, 64, generator=g, requires_grad=True)
            with te_autocast(recipe):
                y = layer(x)
            _expect(RuntimeError, lambda: y.backward(torch.randn(tokens, m, generator=g)),
                    f"{words}. Caller must pad. (K={k_value}")
        layer, _ = attempt(recipe, 24, 64, 96)
        with torch.no_grad(), te_autocast(recipe):
            layer(torch.randn(24, 64, generator=g))  # no backward: fprop's K is in_features


def check_cuda_and_cublas_gates():
    """TE 2.14's CUDA-dependent checks (quantization.py:47-87) on the stood-in CUDA: blockwise FP8
    needs CUDA >= 12.9 (autocast entry raises TE's reason on a CUDA 12.8 Hopper), FP8 on Ada needs
    cuBLASLt >= 12.1.3 and CUDA >= 12.1; autocast_enter asserts FP8 for every recipe, custom too."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import CustomRecipe, Float8BlockScaling
    from transformer_engine.pytorch import quantization as q
    from transformer_engine.pytorch import utils
    from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import nvfp4_ref_rht_2d_quantizer_factory

    assert utils.cuda_version() == "13.0" and utils.get_cublasLt_version() == 130000  # defaults
    x, w, gy = _data(17)
    blockwise = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
    with _environ(TE_DOUBLE_COMPUTE_CAPABILITY="9.0", TE_DOUBLE_CUDA_VERSION="12.8"):
        assert te.is_fp8_block_scaling_available(return_reason=True) == (False, blockwise)
        assert te.is_fp8_available(return_reason=True) == (True, "")
        assert _expect(RuntimeError, lambda: _step(_linear(w), x, gy, Float8BlockScaling()), "CUDA") == blockwise
        assert not q.FP8GlobalStateManager.is_fp8_enabled()
        _step(_linear(w), x, gy, _recipes()["tensorwise"])  # current scaling runs
    with _environ(TE_DOUBLE_COMPUTE_CAPABILITY="9.0", TE_DOUBLE_CUDA_VERSION="12.9"):
        assert te.is_fp8_block_scaling_available()
    ada_cublas = "CublasLt version 12.1.3.x or higher required for FP8 execution on Ada."
    with _environ(TE_DOUBLE_COMPUTE_CAPABILITY="8.9", TE_DOUBLE_CUBLASLT_VERSION="120100"):
        assert te.is_fp8_available(return_reason=True) == (False, ada_cublas)
        assert _expect(RuntimeError, lambda: _step(_linear(w), x, gy, _recipes()["tensorwise"]),
                       "CublasLt") == ada_cublas
        reference = CustomRecipe(qfactory=nvfp4_ref_rht_2d_quantizer_factory)
        assert _expect(AssertionError, lambda: _step(_linear(w), x, gy, reference), "CublasLt") == ada_cublas
        assert not q.FP8GlobalStateManager.is_fp8_enabled() and q.FP8GlobalStateManager.AUTOCAST_DEPTH == 0
    with _environ(TE_DOUBLE_COMPUTE_CAPABILITY="8.9", TE_DOUBLE_CUDA_VERSION="12.0",
                  TE_DOUBLE_CUBLASLT_VERSION="120103"):
        assert te.is_fp8_available(return_reason=True) == \
            (False, "Cuda version 12.1 or higher required for FP8 execution on Ada.")
    with _environ(TE_DOUBLE_COMPUTE_CAPABILITY="8.9"):  # CUDA 13.0: FP8 runs on Ada
        assert te.is_fp8_available() and not te.is_fp8_block_scaling_available()


def _run_python(code: str, pythonpath: str) -> dict:
    """Run `code` in a new interpreter over the doubles on `pythonpath`; the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_VERSION_PROBE = """
import importlib, importlib.util, json, torch
import transformer_engine, transformer_engine.pytorch as te
from megatron.core.utils import get_te_version
from snip_megatron.megatron import runtime
from tests.te import te_worker
from transformer_engine.common.recipe import CustomRecipe
out = {"version": transformer_engine.__version__, "megatron": str(get_te_version())}
for name in ("quantization_nvfp4", "quantization_ref_nvfp4", "reference_nvfp4"):
    path = "transformer_engine.pytorch.custom_recipes." + name
    try:
        module = importlib.import_module(path)
        out[name] = sorted(n for n in vars(module) if n.startswith("nvfp4_ref"))
    except ModuleNotFoundError as error:
        out[name] = "ModuleNotFoundError" if importlib.util.find_spec(path) is None else repr(error)
runtime.initialize_model_parallel(tp=1, pp=1, seed=te_worker.SEED)
model = te_worker.build_te_gpt(gradient_accumulation_fusion=False)  # a plain backward, no DDP main_grad
batch = te_worker.fixed_batches(num=1)[0]
loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
loss.float().mean().backward()
out["megatron_layers"] = type(model.decoder.layers[0].self_attention.linear_qkv).__name__
try:
    with te.autocast(recipe=CustomRecipe(qfactory=lambda role: None)):
        te.Linear(64, 64)(torch.randn(32, 64))
except NotImplementedError as error:
    out["custom_recipe"] = str(error)
print(json.dumps(out))
"""


def check_version_folder_sets_version_and_custom_recipes_layout():
    """A dist-info from te_versions.py before tests/te_double makes the double another TE version
    (importlib.metadata takes the first distribution on sys.path; Megatron's get_te_version reads
    it): on 2.16 `custom_recipes.quantization_nvfp4` is gone as in the 2.16 wheel
    (ModuleNotFoundError) and `quantization_ref_nvfp4` exists; after 2.18 `reference_nvfp4` with
    `nvfp4_ref_rht_2d_factory`. Megatron still builds and runs its TE layers; a CustomRecipe is
    refused (TE >= 2.16's QuantizerRole protocol is not modelled)."""
    import tempfile

    with tempfile.TemporaryDirectory() as parent:
        for version, present, names in (
                ("2.16.0", "quantization_ref_nvfp4", ["nvfp4_ref_rht_2d_quantizer_factory"]),
                ("2.19.0", "reference_nvfp4", ["nvfp4_ref_rht_2d_factory"])):
            out = _run_python(_VERSION_PROBE, double_pythonpath(te_version=te_version_folder(version, parent)))
            assert out["version"] == version and out["megatron"] == version, out
            assert out[present] == names, out
            assert all(out[name] == "ModuleNotFoundError" for name in
                       ("quantization_nvfp4", "quantization_ref_nvfp4", "reference_nvfp4") if name != present), out
            assert out["megatron_layers"] == "TELayerNormColumnParallelLinear", out
            assert f"CustomRecipe on TE {version}" in out["custom_recipe"], out


_APEX_PROBE = """
import json, torch
from snip_megatron.megatron import runtime
runtime.initialize_model_parallel(tp=1, pp=1, seed=1)
from megatron.core.tensor_parallel import layers
from megatron.core.transformer.transformer_config import TransformerConfig
config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                           use_cpu_initialization=True, gradient_accumulation_fusion=True)
layer = layers.ColumnParallelLinear(16, 32, config=config, init_method=torch.nn.init.xavier_normal_,
                                    bias=False, gather_output=False)
weight = layer.weight
weight.main_grad = torch.zeros(32, 16)
weight.grad_added_to_main_grad = False
g, want, before = torch.Generator().manual_seed(0), torch.zeros(32, 16), weight.detach().clone()
for _ in range(2):
    x = torch.randn(8, 2, 16, generator=g, requires_grad=True)
    gy = torch.randn(8, 2, 32, generator=g)
    layer(x)[0].backward(gy)
    want += gy.reshape(-1, 32).t() @ x.detach().reshape(-1, 16)
opt = torch.optim.SGD([weight], lr=0.1)
weight.grad = weight.main_grad.clone()  # what Megatron's DDP hands its optimizer
opt.step()
print(json.dumps({"available": layers._grad_accum_fusion_available,
                  "max_diff": float((weight.main_grad - want).abs().max()),
                  "added": weight.grad_added_to_main_grad, "moved": bool((weight != before).all())}))
"""


def check_apex_double_runs_megatrons_fused_wgrad():
    """tests/apex_double on sys.path: Megatron's ColumnParallelLinear (the GPT output layer) accepts
    gradient_accumulation_fusion=True and accumulates dW into main_grad in FP32 through
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 (its dummy wgrad comes from the TE double's
    get_dummy_wgrad; without a TE it would allocate on torch.cuda.current_device())."""
    out = _run_python(_APEX_PROBE, double_pythonpath(apex=True))
    assert out["available"] and out["added"] and out["moved"], out
    assert out["max_diff"] < 1e-5, out


if __name__ == "__main__":
    run_checks(dict(globals()), __doc__.split("\n")[0], setup=share_snip_noise)
