"""Checks of Megatron-Core's real TE wrappers over the TE test double, in one process (TP=PP=1).

    PYTHONPATH=<repo>:<repo>/tests/te_double python tests/te/megatron_checks.py --out FILE
    PYTHONPATH=... NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python tests/te/megatron_checks.py --out FILE \
        --only check_te_dicts_and_measured_formats_name_the_same_numerics

tests/te/test_te_double.py runs it in subprocesses (both lanes) and asserts every check passed:
once with TE's default environment, and the formats check again with FP32 block scales (TE reads
that switch once, at import); `check_trains_at_tp1.data` holds the TP=1 losses the torchrun TP=2 /
PP=2 runs are compared with.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from check_runner import run_checks  # noqa: E402
from snip_vs_double import agree  # noqa: E402
from tests.te import te_worker as worker  # noqa: E402


def setup() -> None:
    worker.require_double()
    torch.set_num_threads(1)
    from snip_megatron.megatron import runtime

    runtime.initialize_model_parallel(tp=1, pp=1, seed=worker.SEED)


def check_import_sees_te_and_its_version():
    from importlib import metadata

    from packaging.version import Version

    import megatron.core.extensions.transformer_engine as mte
    from megatron.core import fp4_utils, fp8_utils
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import get_te_version, is_te_min_version

    assert mte.HAVE_TE and fp8_utils.HAVE_TE and fp4_utils.HAVE_TE and mrandom.HAVE_TE
    assert get_te_version() == Version("2.14.0") == Version(metadata.version("transformer-engine"))
    assert is_te_min_version("2.7.0") and not is_te_min_version("2.15.0")
    import transformer_engine.pytorch as te

    assert issubclass(mte.TELinear, te.Linear) and issubclass(mte.TEDotProductAttention,
                                                              te.DotProductAttention)


def check_layer_spec_builds_te_wrappers():
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import (TEDotProductAttention,
                                                             TELayerNormColumnParallelLinear,
                                                             TERowParallelLinear)

    model = worker.build_te_gpt()
    for layer in model.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        assert type(attn.linear_qkv) is TELayerNormColumnParallelLinear
        assert isinstance(attn.linear_qkv, te.LayerNormLinear)
        assert attn.linear_qkv.normalization == "RMSNorm" and attn.linear_qkv.layer_norm_bias is None
        assert type(attn.core_attention) is TEDotProductAttention
        assert (attn.core_attention.num_attention_heads, attn.core_attention.num_gqa_groups) == (4, 2)
        assert type(attn.linear_proj) is TERowParallelLinear and attn.linear_proj.parallel_mode == "row"
        assert type(mlp.linear_fc1) is TELayerNormColumnParallelLinear
        assert mlp.linear_fc1.out_features == 2 * worker.SHAPE.ffn_hidden_size  # SwiGLU gate + up
        assert type(mlp.linear_fc2) is TERowParallelLinear
        assert type(layer.input_layernorm).__name__ == "IdentityOp"  # the norm is fused in
    assert type(model.decoder.final_layernorm) is te.RMSNorm  # TENorm
    assert model.config.gated_linear_unit and model.config.activation_func is F.silu
    assert model.position_embedding_type == "rope" and hasattr(model, "rotary_pos_emb")
    assert model.output_layer.weight is not model.embedding.word_embeddings.weight
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names


def check_te_spec_trains_like_the_local_spec():
    """Same seed: Megatron's local-spec model and the TE-spec model over the double draw the same
    weights and must follow the same loss curve (attention, norms and GEMMs agree)."""
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.model import build_gpt_model

    runtime.seed_all(worker.SEED)
    te_losses = worker.train(worker.build_te_gpt())
    runtime.seed_all(worker.SEED)
    local_losses = worker.train(build_gpt_model(worker.SHAPE, backend="local"))
    assert len(te_losses) == worker.STEPS
    for a, b in zip(te_losses, local_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (te_losses, local_losses)
    return {"te": te_losses, "local": local_losses}


def check_trains_at_tp1():
    """The TP=1 references for the torchrun runs: Megatron's init and the by-name init."""
    data = {variant: worker.run_variant(variant)["losses"] for variant in ("megatron_init", "name_init")}
    for losses in data.values():
        assert losses[-1] < 0.85 * losses[0], losses
    return data


def check_plan_reaches_te_quant_params():
    """build_recipe(plan, backend='te', sm=100) -> quant_recipe -> finish_init -> te_quant_params."""
    from megatron.core.enums import Fp4Recipe, Fp8Recipe

    model = worker.build_te_gpt(the_plan=worker.plan())
    modules = worker.planned_linears(model)
    assert sorted(modules) == sorted(f"{layer}.{name}" for layer, name in worker.PLAN_TABLE)
    for key, module in modules.items():
        precision = _planned(key)
        recipe = module.te_quant_params.training_recipe
        assert recipe.override_quantized_autocast and recipe.override_nonquantized_autocast, key
        want8 = Fp8Recipe.blockwise if precision == "fp8" else None
        want4 = Fp4Recipe.nvfp4 if precision == "fp4" else None
        assert (recipe.fp8_quantization_recipe, recipe.fp4_quantization_recipe) == (want8, want4), key
        assert module.will_execute_quantized(False) == (precision != "bf16"), key


@contextlib.contextmanager
def capability(sm: int):
    """The double's GPU generation (TE_DOUBLE_COMPUTE_CAPABILITY) for the block's duration."""
    old = os.environ.get("TE_DOUBLE_COMPUTE_CAPABILITY")
    os.environ["TE_DOUBLE_COMPUTE_CAPABILITY"] = f"{sm // 10}.{sm % 10}"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TE_DOUBLE_COMPUTE_CAPABILITY"]
        else:
            os.environ["TE_DOUBLE_COMPUTE_CAPABILITY"] = old


# Every recipe flag of SnipConfig, alone (the defaults first).
RECIPE_FLAGS = [{}, {"fp8_format": "hybrid"}, {"fp8_recipe": "tensorwise"},
                {"fp8_recipe": "tensorwise", "fp8_format": "e4m3"}, {"fp8_recipe": "mxfp8"},
                {"fp8_block_scales": "pow2"}, {"fp8_block_scales": "fp32"},
                {"fp4_gradient_rounding": "nearest"}, {"fp4_gradient_rounding": "stochastic"},
                {"fp4_recipe": "mxfp4"}]


def _what_the_double_runs(config: dict):
    """What a TE linear of the double computes inside the autocast Megatron opens for `config` (a
    TEQuantizationParams dict) on fixed data: ("high_precision", None) outside FP8/FP4, (its label,
    (Y, dX, dW)) when quantized, or the error it raises (a string). 32 tokens: every recipe's
    shape rule holds (MXFP8's blocks of 32)."""
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import _get_fp8_autocast_for_quant_params

    params = _parse(config)
    x, w, gy = _linear_data()
    layer = te.Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.sr_generator.manual_seed(worker.SEED)
    xg = x.clone().requires_grad_()
    try:
        with _get_fp8_autocast_for_quant_params(params, True):
            y = layer(xg)
        y.backward(gy)
    except (NotImplementedError, RuntimeError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    if not layer.last_run.quantized:
        return "high_precision", None
    return layer.last_run.formats, (y.detach(), xg.grad, layer.weight.grad)


def _linear_data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g) * 0.1, torch.randn(32, 32, generator=g)


def _what_snip_computes(spec):
    """(Y, dX, dW) of SNIP's quantized_linear for `spec` on `_linear_data()`, its stochastic
    rounding seeded as the double's linear in `_what_the_double_runs` (share_snip_noise)."""
    from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear

    x, w, gy = _linear_data()
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_linear(x, w, None, spec, QuantRuntime(generator=torch.Generator().manual_seed(worker.SEED)))
    y.backward(gy)
    return y.detach(), x.grad, w.grad


def _runs_like(ran, spec) -> bool:
    """Whether what the double ran (`_what_the_double_runs`) is what SNIP computes for `spec`."""
    if isinstance(ran, str) or ran[1] is None:
        return False
    return ran[0] == spec.recipe and agree(ran[1], _what_snip_computes(spec), ran[0])


def _named(ran) -> str:
    return ran if isinstance(ran, str) else f"the double ran {ran[0]}, not those numbers"


def _parse(config: dict):
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig

    return TEQuantizationParams.parse_from_config(
        QuantizationConfig(config, MatchContext("decoder.layers.0.mlp.linear_fc1", 0), "k"))


def check_te_dicts_and_measured_formats_name_the_same_numerics():
    """For SM90 and SM100 and each recipe flag: the formats SNIP measures (SnipConfig resolved for
    TE -> measure_config().formats) and what the double's TE linear computes inside the autocast
    Megatron opens from the TE dict of the plan (config_dict_for) are the same numbers (Y, dX, dW
    of SNIP's quantized_linear for that FormatSpec; snip_vs_double.agree), per precision the GPU's
    plan uses (SM90: BF16/FP8, and any FP4 setting refused). A flag the start-up refuses would have
    computed something else (or nothing): the dict of what was asked does not compute it."""
    from snip_megatron.config import SnipConfig
    from snip_megatron.megatron.quant_recipe import config_dict_for
    from snip_megatron.te import read_te_support, te_params

    report = {}
    for sm in (90, 100):
        quantized = ("fp8", "fp4") if sm >= 100 else ("fp8",)
        with capability(sm):
            for flags in RECIPE_FLAGS:
                name = f"SM{sm} " + (",".join(f"{k}={v}" for k, v in flags.items()) or "defaults")
                snip = SnipConfig(enabled=True, **flags)  # the plan's precisions: what this GPU runs
                try:
                    run = snip.resolved("te", sm=sm, support=read_te_support())
                except ValueError as refusal:
                    asked = snip.formats
                    differs = []
                    for p in ("fp8", "fp4"):
                        try:
                            ran = _what_the_double_runs(te_params(p, formats=asked, sm=sm))
                        except ValueError as no_dict:  # no TE recipe on this GPU at all
                            ran = f"no TE dict: {no_dict}"
                        if not _runs_like(ran, asked.spec(p)):
                            differs.append(f"{p}: {_named(ran)}")
                    assert differs, (name, str(refusal))
                    report[name] = "refused: " + "; ".join(differs)
                    continue
                formats = run.measure_config().formats
                configs = config_dict_for("te", sm=sm, formats=formats)
                assert set(configs) == {"bf16", *quantized}, (name, configs)
                for p in quantized:
                    ran = _what_the_double_runs(configs[p])
                    assert _runs_like(ran, formats.spec(p)), (name, p, _named(ran), formats.spec(p).short_str())
                assert _what_the_double_runs(configs["bf16"]) == ("high_precision", None)
                report[name] = formats.short_str()
    return report


# Hopper's plan: every linear kind meets BF16 and FP8 across the two layers (no FP4 with TE).
HOPPER_PLAN = {(1, "linear_qkv"): "fp8", (1, "linear_proj"): "bf16", (1, "linear_fc1"): "fp8",
               (1, "linear_fc2"): "fp8", (2, "linear_qkv"): "bf16", (2, "linear_proj"): "fp8",
               (2, "linear_fc1"): "bf16", (2, "linear_fc2"): "fp8"}


def check_hopper_plans_bf16_fp8_and_trains_them_with_fused_wgrad():
    """SM90 (issue 31, failures 1 and 3): `--snip` alone resolves to a BF16/FP8 plan under an FP8
    budget, TE has no FP4 dict there and a plan with FP4 is refused before any module is built.
    The BF16/FP8 plan runs bit-exactly our emulation per linear and, with Megatron's fused wgrad
    (DDP main_grad), moves every planned weight at every step (FP4 through TE's reference custom
    recipe, what SNIP ran here before, left its weights unmoved: its GEMM drops dW under fusion)."""
    from snip_megatron.config import SnipConfig
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import apply_plan
    from snip_megatron.megatron.quant_recipe import build_recipe, config_dict_for
    from snip_megatron.plan import LayerKey, Plan
    from snip_megatron.te import read_te_support

    with capability(90):
        run = SnipConfig(enabled=True).resolved("te", sm=90, support=read_te_support())
        assert (run.precisions, run.budget, run.fp8_budget) == (["bf16", "fp8"], "fp8_fraction", 0.9)
        assert set(config_dict_for("te", sm=90, formats=run.formats)) == {"bf16", "fp8"}
        try:
            build_recipe(worker.plan(), backend="te", sm=90, formats=run.formats)
        except ValueError as refusal:
            assert "fp4, which the te backend cannot run here: FP4 nvfp4: TE's NVFP4 kernels need SM100+" \
                in str(refusal), refusal
        else:
            raise AssertionError("a plan with FP4 linears was accepted on SM90")
        hopper = Plan({LayerKey(layer, name): p for (layer, name), p in HOPPER_PLAN.items()})
        runtime.seed_all(worker.SEED)
        config = make_config()
        model = worker.build_te_gpt(quant_recipe=worker.te_recipe_for(config, hopper, sm=90))
        apply_plan(model, hopper, sm=90, formats=run.formats)
        labels = {"fp8": "blockwise", "bf16": "high_precision"}
        g = torch.Generator().manual_seed(6)
        for key, module in worker.planned_linears(model).items():
            fmt = labels[HOPPER_PLAN[(int(key.split(".")[0]), key.split(".")[1])]]
            x, gy, state, got, _ = _forward_backward(module, g)
            assert module.last_run.label == fmt and module.fuse_wgrad_accumulation, (key, module.last_run)
            want = _reference(module, x, gy, fmt, state, sm=90)
            assert agree(got, want, fmt), key
            module.zero_grad(set_to_none=True)
        records: list = []
        losses = worker.train(model, records=records)
        _check_every_step(records)
        assert losses[-1] < 0.85 * losses[0], losses
        return losses


def _check_every_step(records: list) -> None:
    """Every planned weight moved at every step, its fused main_grad was nonzero, and each quantized
    forward read this step's weight."""
    assert len(records) == worker.STEPS, records
    for i, r in enumerate(records):
        assert r["unmoved"] == [] and r["zero_main_grad"] == [] and r["stale"] == [], (i, r)


def check_megatron_alone_leaves_te_weights_stale_before_0_19():
    """Issue 31, failure 2, in Megatron itself: a model built with a quant_recipe and trained by
    Megatron's schedule, without SNIP's `apply_plan`: megatron-core >= 0.19 re-arms TE's weight
    cache each step (`set_is_first_microbatch` with a quant_recipe), 0.16-0.18 only under a global
    fp8/fp4, so there step 2 on reuses the quantized weights of step 1. (With SNIP's apply_plan,
    as every loop runs it, no step is stale: check_mixed_plan_trains_and_each_module_keeps_its_format.)"""
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import megatron_core_version, megatron_rearms_te_cache

    runtime.seed_all(worker.SEED)
    model = worker.build_te_gpt(the_plan=worker.plan())
    records: list = []
    worker.train(model, steps=3, records=records)
    stale = [sorted(r["stale"]) for r in records]
    quantized = sorted(k for k, p in {f"{a}.{b}": v for (a, b), v in worker.PLAN_TABLE.items()}.items()
                       if p != "bf16")
    assert stale[0] == [], stale  # step 1 builds the cache from its own weights
    if megatron_rearms_te_cache(model.config):  # 0.19.2 (prod lane); not 0.16.1 (compat)
        assert stale[1:] == [[], []], stale
        assert {r["workspaces"][quantized[0]] for r in records[1:]} == {"reused"}  # refreshed, then reused
    else:
        assert stale[1:] == [quantized, quantized], stale
    return {"megatron_core": ".".join(map(str, megatron_core_version())), "stale": stale}


def check_step2_quantized_forward_equals_emulation_on_step2_weights():
    """Through Megatron's schedule and SNIP's apply_plan, in both lanes: each planned linear's first
    forward of step 2 gives exactly our emulation of its planned format on the weights of step 2
    (and not on those of step 1): TE's weight cache is refreshed per step, or off."""
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import apply_plan

    runtime.seed_all(worker.SEED)
    model = worker.build_te_gpt(the_plan=worker.plan())
    apply_plan(model, worker.plan(), sm=100, formats=worker.formats_on(100))
    linears = worker.planned_linears(model)
    weights, seen, handles = {}, {}, []

    def before_step(i):
        weights[i] = {k: {n: p.detach().clone() for n, p in m.named_parameters()} for k, m in linears.items()}

    def capture(key):
        def hook(module, args, output):
            if len(weights) == 2 and key not in seen:  # step 2's first forward
                seen[key] = (args[0].detach().clone(), (output[0] if isinstance(output, tuple) else output).detach())
        return hook

    for key, module in linears.items():
        handles.append(module.register_forward_hook(capture(key)))
    worker.train(model, steps=2, before_step=before_step)
    for h in handles:
        h.remove()
    checked = {}
    for key, module in linears.items():
        fmt = worker.EXPECTED_LABEL[_planned(key)]
        x, y = seen[key]
        want2 = _forward_with(module, x, weights[1][key], fmt)
        assert agree(y, want2, fmt), key
        if fmt != "high_precision":  # not vacuous: step 1's weight (step 2's norm) gives other bits
            stale = dict(weights[1][key], weight=weights[0][key]["weight"])
            assert not torch.equal(y, _forward_with(module, x, stale, fmt)), key
        checked[key] = fmt
    return checked


def _forward_with(module, x, params: dict, fmt: str):
    """Our emulation's forward output of `module` (RMSNorm in front for the fused ones) with the
    parameters `params` ({name: tensor})."""
    from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear

    h = _rms(x, params["layer_norm_weight"], module.eps) if "layer_norm_weight" in params else x
    weight = params["weight"]
    if fmt == "high_precision":
        return F.linear(h, weight)
    spec = worker.formats_on(100).spec("fp4" if fmt == "nvfp4" else "fp8")
    return quantized_linear(h, weight, None, spec, QuantRuntime(generator=torch.Generator()))


def make_config():
    from snip_megatron.megatron.model import make_transformer_config

    return make_transformer_config(worker.SHAPE)


def _rms(x, gamma, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(x.dtype)


def _planned(key: str) -> str:
    """The precision worker.plan() gives the linear `key` ("<layer>.<name>")."""
    layer, name = key.split(".")
    return worker.PLAN_TABLE[(int(layer), name)]


def _forward_backward(module, g):
    """One forward and backward of a planned linear on random X and G_Y: (X, G_Y, the module's
    stochastic-rounding generator state before it ran, [Y, dX, dW(, dgamma)], the returned bias).
    Under fused wgrad (Megatron's GPU default) dW is what TE adds to a zeroed FP32 `main_grad`,
    as Megatron's DDP gives the weight."""
    x = torch.randn(worker.SHAPE.seq_length, 2, module.in_features, generator=g)
    gy = torch.randn(worker.SHAPE.seq_length, 2, module.out_features, generator=g)
    state = module.sr_generator.get_state()
    fused = module.fuse_wgrad_accumulation
    if fused:
        module.weight.main_grad = torch.zeros_like(module.weight, dtype=torch.float32)
    xg = x.clone().requires_grad_()
    y, bias = module(xg)
    y.backward(gy)
    if fused:
        dw = module.weight.main_grad.to(module.weight.dtype)
        assert module.weight.grad is None  # TE hands autograd no wgrad without grad_added_to_main_grad
        del module.weight.main_grad
    else:
        dw = module.weight.grad
    got = [y.detach(), xg.grad, dw]
    if hasattr(module, "layer_norm_weight"):
        got.append(module.layer_norm_weight.grad)
    return x, gy, state, got, bias


def _reference(module, x, gy, fmt, generator_state, sm: int = 100):
    """(y, dX, dW[, dgamma]) from our own quantized_linear (or the plain GEMM) on the module's
    weights, in the formats TE runs on SM`sm`, with the RMSNorm in front for the fused LayerNorm
    linears."""
    from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear

    x = x.clone().requires_grad_()
    w = module.weight.detach().clone().requires_grad_()
    leaves = [x, w]
    h = x
    if hasattr(module, "layer_norm_weight"):
        gamma = module.layer_norm_weight.detach().clone().requires_grad_()
        leaves.append(gamma)
        h = _rms(x, gamma, module.eps)
    if fmt == "high_precision":
        y = F.linear(h, w)
    else:
        spec = worker.formats_on(sm).spec("fp4" if fmt == "nvfp4" else "fp8")
        generator = torch.Generator()
        generator.set_state(generator_state)
        y = quantized_linear(h, w, None, spec, QuantRuntime(generator=generator))
    y.backward(gy)
    return [y.detach()] + [leaf.grad for leaf in leaves]


def check_planned_modules_compute_our_emulation():
    """Each planned TE linear (forward through Megatron's wrapper, which opens the per-module TE
    autocast) computes what SNIP's quantized_linear computes for its planned format, from the
    double's own TE quantizers: output, input and weight gradients, bit for bit (NVFP4 within a
    few FP32 ulps, snip_vs_double.agree)."""
    model = worker.build_te_gpt(the_plan=worker.plan())
    g = torch.Generator().manual_seed(5)
    report = {}
    for key, module in worker.planned_linears(model).items():
        precision = _planned(key)
        fmt = worker.EXPECTED_LABEL[precision]
        x, gy, state, got, bias = _forward_backward(module, g)
        assert bias is None
        assert module.last_run.label == fmt, (key, module.last_run)
        want = _reference(module, x, gy, fmt, state)
        assert agree(got, want, fmt), key
        if fmt != "high_precision":  # the comparison is not vacuous: quantized != plain
            assert not torch.equal(got[0], _reference(module, x, gy, "high_precision", state)[0]), key
        report[key] = fmt
    assert sorted(set(report.values())) == ["blockwise", "high_precision", "nvfp4"]
    return report


def _forward_once(model):
    from snip_megatron.megatron.batch import random_batch

    batch = random_batch(2, worker.SHAPE.seq_length, worker.SHAPE.vocab_size,
                         torch.Generator().manual_seed(9))
    model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


def _labels(model) -> dict:
    return {key: m.last_run.label for key, m in worker.planned_linears(model).items()}


def _with_flag(recipe_config, flag: str, value: bool):
    for config in recipe_config.configs.values():
        config["training_recipe"][flag] = value
    return recipe_config


def check_module_recipe_nests_inside_global_autocast():
    """Megatron's global --fp8 autocast (MXFP8 here) around each layer, TE's per-module autocast
    inside: with override_quantized_autocast the module's own recipe wins (BF16 plans run plain),
    without it the module follows the global recipe; with override_nonquantized_autocast off and
    no global autocast, planned modules stay in high precision."""
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.model import make_transformer_config

    planned = {f"{layer}.{name}": worker.EXPECTED_LABEL[p] for (layer, name), p in worker.PLAN_TABLE.items()}
    global_fp8 = dict(fp8="e4m3", fp8_recipe="mxfp8")

    def labels_for(the_plan, flag=None, **overrides):
        runtime.seed_all(worker.SEED)
        config = make_transformer_config(worker.SHAPE, **overrides)
        recipe = worker.te_recipe_for(config, the_plan) if the_plan is not None else None
        if recipe is not None and flag is not None:
            _with_flag(recipe, flag, False)
        model = worker.build_te_gpt(quant_recipe=recipe, **overrides)
        _forward_once(model)
        return _labels(model)

    assert labels_for(worker.plan(), **global_fp8) == planned
    everything_mxfp8 = {key: "mxfp8" for key in planned}
    assert labels_for(None, **global_fp8) == everything_mxfp8
    assert labels_for(worker.plan(), "override_quantized_autocast", **global_fp8) == everything_mxfp8
    assert labels_for(worker.plan(), "override_nonquantized_autocast") == \
        {key: "high_precision" for key in planned}


def check_mixed_plan_trains_and_each_module_keeps_its_format():
    """SM100's mixed plan (FP8, NVFP4, BF16), as a SNIP loop runs it (quant_recipe, then apply_plan),
    with Megatron's fused wgrad: it trains, each module keeps its format, and at every step every
    planned weight moved, its main_grad was nonzero and each quantized forward read that step's weight."""
    result = worker.run_variant("plan")
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.85 * losses[0], losses
    _check_every_step(result["steps"])
    forwards = worker.NUM_MICRO * worker.STEPS
    for key, counts in result["runs"].items():
        layer, name = int(key.split(".")[0]), key.split(".")[1]
        label = worker.EXPECTED_LABEL[worker.PLAN_TABLE[(layer, name)]]
        assert counts == {label: forwards}, (key, counts)
    return losses


def check_te_rng_tracker_drives_attention_dropout():
    """model_parallel_cuda_manual_seed(te_rng_tracker=True) builds Megatron's TECudaRNGStatesTracker
    on the double's tracker; TE attention dropout forks it (reproducible from the seed)."""
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import TECudaRNGStatesTracker
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.enums import AttnMaskType

    def run(attn):
        return attn(q, kv, kv, None, AttnMaskType.causal)

    def seeded_model():
        torch.manual_seed(worker.SEED)
        mrandom.model_parallel_cuda_manual_seed(worker.SEED, te_rng_tracker=True, force_reset_rng=True)
        return worker.build_te_gpt(attention_dropout=0.5)

    try:
        model = seeded_model()
        tracker = mrandom.get_cuda_rng_tracker()
        assert isinstance(tracker, TECudaRNGStatesTracker) and isinstance(tracker, te.CudaRNGStatesTracker)
        assert tracker.is_initialized() and "model-parallel-rng" in mrandom.get_all_rng_states()
        attn = model.decoder.layers[0].self_attention.core_attention
        assert attn.get_rng_state_tracker is mrandom.get_cuda_rng_tracker
        g = torch.Generator().manual_seed(1)
        q = torch.randn(8, 1, 4, 16, generator=g)
        kv = torch.randn(8, 1, 2, 16, generator=g)
        first, second = run(attn), run(attn)
        assert not torch.equal(first, second), "dropout did not advance the tracked RNG"
        model = seeded_model()
        attn = model.decoder.layers[0].self_attention.core_attention
        assert torch.equal(run(attn), first)
        attn.eval()
        assert torch.equal(run(attn), run(attn))
    finally:
        mrandom.model_parallel_cuda_manual_seed(worker.SEED, te_rng_tracker=False, force_reset_rng=True)


if __name__ == "__main__":
    run_checks(dict(globals()), __doc__.split("\n")[0], setup=setup)
