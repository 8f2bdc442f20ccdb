"""Linears Transformer Engine cannot run in FP8/FP4 for their shapes: found from the layout, kept out
of those precisions by the controller (initial plan, every solve, baselines, resumed plans), a saved
plan or a budget that needs them refused at construction (start-up)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.controller import SnipController
from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.plan import LayerKey, Plan, all_keys
from snip_megatron.shapes import PRESETS, ModelShape
from snip_megatron.te.shapes import LocalGemm, describe_exclusions, local_gemms, shape_problem, te_exclusions

# linear_fc2's input features (ffn 200) are not a multiple of 16: no FP8 or FP4 for it anywhere.
ODD_FFN = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=200, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, seq_length=32)
FP8_FP4 = (Precision.FP8, Precision.FP4)


def test_local_shapes_of_a_70b_tp8_rank_run_every_recipe():
    gemms = local_gemms(PRESETS["llama_70b"], tp=8, sequence_parallel=True, micro_batch_size=1)
    # SP shards their input; their GEMMs run on the gathered 4096 tokens
    assert gemms["linear_qkv"] == LocalGemm(out_features=1280, in_features=8192, tokens=512, gemm_tokens=4096)
    assert gemms["linear_fc1"] == LocalGemm(out_features=7168, in_features=8192, tokens=512, gemm_tokens=4096)
    assert gemms["linear_proj"] == LocalGemm(out_features=8192, in_features=1024, tokens=4096)  # whole sequence
    assert gemms["linear_fc2"] == LocalGemm(out_features=8192, in_features=3584, tokens=4096)
    for gemm in gemms.values():
        assert all(shape_problem(r, gemm) is None for r in ("blockwise", "tensorwise", "mxfp8", "nvfp4"))
    assert te_exclusions(PRESETS["llama_70b"], Formats(), FP8_FP4, tp=8, sequence_parallel=True) == {}


def test_te_shape_rules_per_recipe():
    assert "divisible by 8 and last dim by 16; this rank's weight 64x200 and input 32x200" in \
        shape_problem("blockwise", LocalGemm(64, 200, 32))
    assert shape_problem("blockwise", LocalGemm(64, 208, 32)) is None
    assert "by 32" in shape_problem("mxfp8", LocalGemm(64, 208, 32))  # MXFP8 blocks of 32
    assert "input 24x64" in shape_problem("nvfp4", LocalGemm(64, 64, 24))  # NVFP4 blocks of 16
    assert shape_problem("tensorwise", LocalGemm(64, 64, 32)) is None
    excluded = te_exclusions(ODD_FFN, Formats(), FP8_FP4)
    assert set(excluded) == {LayerKey(1, "linear_fc2"), LayerKey(2, "linear_fc2")}
    assert set(excluded[LayerKey(1, "linear_fc2")]) == set(FP8_FP4)
    assert describe_exclusions(excluded)[0].startswith("linear_fc2 kept out of FP8 in every layer: TE's blockwise")
    # 12 tokens per rank: every linear, under TE's rule on the leading dims.
    tiny_batch = te_exclusions(ODD_FFN.with_(ffn_hidden_size=192, seq_length=12), Formats(), FP8_FP4)
    assert set(tiny_batch) == set(all_keys(2))


def controller(tmp_path, solve=None, **cfg):
    base = dict(enabled=True, fp4_budget=0.5, interval=10, lag=0, warmup=2, solver_time_limit_s=5.0)
    base.update(cfg)
    applied, logs = [], []
    ctrl = SnipController(SnipConfig(**base), ODD_FFN, total_steps=100, run_dir=tmp_path, log=logs.append,
                          excluded=te_exclusions(ODD_FFN, Formats(), FP8_FP4),
                          measure=lambda ctx, step: "stats", estimate=lambda stats: costs(),
                          apply=lambda ctx, plan: applied.append(plan), **({"solve": solve} if solve else {}))
    ctrl.attach(SimpleNamespace(step=0))
    return ctrl, applied


def costs():
    """FP4 cheapest on the fc2 linears (the planner would pick them first if it could)."""
    table = {k: {Precision.BF16: 0.0, Precision.FP8: 0.1,
                 Precision.FP4: 0.01 if k.name == "linear_fc2" else 1.0} for k in all_keys(2)}
    return SimpleNamespace(costs=table, loss_div=table, weight_div=table, nonfinite={})


def test_the_controller_never_plans_what_te_cannot_run(tmp_path):
    ctrl, applied = controller(tmp_path, precisions="bf16,fp8,fp4")
    fc2 = [k for k in all_keys(2) if k.name == "linear_fc2"]
    assert all(applied[0][k] is Precision.BF16 for k in fc2)  # initial FP8: not for fc2
    for step in range(0, 3):
        ctrl.on_step_start(None, step)
        ctrl.on_step_end(None, step, {"loss": 1.0})
    plan = ctrl.plan
    assert len(applied) == 2 and plan.counts()["fp4"] > 0
    assert all(plan[k] is Precision.BF16 for k in fc2), plan  # cheapest in FP4, yet BF16
    # A saved plan with FP8 on fc2 is refused, not half-run.
    path = tmp_path / "plan.json"
    Plan.uniform(2, "fp8").save(path)
    with pytest.raises(ValueError, match=r"cannot run for their shapes: 1.linear_fc2=fp8"):
        controller(tmp_path, plan=str(path))
    # A resumed plan of another layout keeps out what this one cannot run.
    state = ctrl.state_dict()
    state["plan"] = Plan.uniform(2, "fp4").to_dict()
    ctrl.load_state_dict(state)
    assert all(ctrl.plan[k] is Precision.BF16 for k in fc2) and ctrl.plan[LayerKey(1, "linear_qkv")] is Precision.FP4


def test_a_budget_the_runnable_linears_cannot_meet_is_refused_at_start(tmp_path):
    # The fc2 linears hold 200/(200+...) of the FLOPs; a 95% FP4 budget needs them.
    with pytest.raises(ValueError, match="the linears the backend can run for their shapes cannot meet the plan "
                                         "budget: infeasible budget"):
        controller(tmp_path, fp4_budget=0.95)
    controller(tmp_path, fp4_budget=0.5)  # fine without them


def test_shapes_follow_the_models_mlp_gating_and_head_width():
    """A non-gated MLP and Megatron's kv_channels give TE's rules the shapes the model really has
    (fc1 of 100 outputs without SwiGLU is refused for FP8, not called 200 x 64)."""
    plain = ODD_FFN.with_(ffn_hidden_size=100, gated_linear_unit=False)
    assert local_gemms(plain)["linear_fc1"] == LocalGemm(out_features=100, in_features=64, tokens=32)
    assert set(te_exclusions(plain, Formats(), (Precision.FP8,))[LayerKey(1, "linear_fc1")]) == {Precision.FP8}
    wide = ODD_FFN.with_(ffn_hidden_size=192, kv_channels=24)  # 4 heads of 24 channels on hidden 64
    assert local_gemms(wide)["linear_qkv"].out_features == (4 + 2 * 2) * 24
    assert local_gemms(wide)["linear_proj"] == LocalGemm(out_features=64, in_features=96, tokens=32)


def test_fp8_gemms_need_their_inner_dimension_divisible_by_16():
    """cuBLAS's FP8 GEMMs (TE 2.14 common/gemm/cublaslt_gemm.cu:158-162, 207-214, 250-254, 293-300,
    'Caller must pad'): wgrad's K is the tokens, dgrad's the local out_features. Both pass TE's
    Python assert (leading dims % 8) and crash at the first FP8 backward; MXFP8 and NVFP4 have
    their own blocks."""
    for recipe in ("tensorwise", "blockwise"):
        assert shape_problem(recipe, LocalGemm(64, 64, 24)) == (
            f"cuBLAS's FP8 GEMMs ({recipe}) need the inner dimension divisible by 16 (TE: 'Caller must pad'); "
            "this rank's wgrad K=24 (dgrad: the local out_features, wgrad: the tokens) are not")
        assert "dgrad K=40 and wgrad K=24" in shape_problem(recipe, LocalGemm(40, 64, 24))
        assert shape_problem(recipe, LocalGemm(48, 64, 32)) is None
    # under SP the local input (8 tokens) is gathered for the GEMMs: K = 16 tokens at TP=2
    assert shape_problem("blockwise", LocalGemm(64, 64, 8, gemm_tokens=16)) is None
    assert "wgrad K=24" in shape_problem("blockwise", LocalGemm(64, 64, 8, gemm_tokens=24))
    # a sequence of 24 tokens: every linear kept out of FP8 (TE's assert alone would let it through)
    short = te_exclusions(ODD_FFN.with_(ffn_hidden_size=192, seq_length=24), Formats(), (Precision.FP8,))
    assert set(short) == set(all_keys(2))
    assert "wgrad K=24" in describe_exclusions(short)[0]
    # NVFP4 at the same shapes: its own blocks of 16 are the rule
    assert te_exclusions(ODD_FFN.with_(ffn_hidden_size=192, seq_length=24), Formats(), (Precision.FP4,)) != {}
    assert shape_problem("nvfp4", LocalGemm(64, 64, 32)) is None
