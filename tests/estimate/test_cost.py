import math

import numpy as np
import pytest

from snip_megatron.estimate import EstimateConfig, cost_table, proxy_table
from snip_megatron.estimate import divergence as dv
from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey, all_keys
from snip_megatron.stats.table import StatsTable, precision_field

FP8, FP4 = Precision.FP8, Precision.FP4


def make_table(num_layers=2, err=(1e-4, 1e-2), kappa=1.0, adam=True, measured=True, **overrides) -> StatsTable:
    """A hand-built table: every layer alike unless overridden ({field: {layer_index: value}}).
    measured: dy_sq and gdy_sq as the random-error model predicts them (else left 0)."""
    keys = all_keys(num_layers)
    t = StatsTable(keys=keys, globals_={"loss": 2.0, "num_microbatches": 1, "dp_size": 1})
    base = dict(x_sq=100.0, w_sq=10.0, y_sq=50.0, gy_sq=1e-2, gx_sq=1e-2, gw_sq=1e-3, n=64, k=16, m=16,
                fwd_zg_clean=0.0, fwd_zg_noisy=kappa * 0.1 * 1000.0, fwd_z_sq=1000.0, noise_scale=0.1,
                bwd_dgw_sq=1.0, bwd_eta_sq=1.0, adam_du_sq=160.0 if adam else 0.0,
                adam_dv_sq=16.0 if adam else 0.0, adam_v_sum=16.0 if adam else 0.0,
                adam_upd_sq=50.0 if adam else 0.0, adam_numel=160.0 if adam else 0.0, present=1.0)
    for f, v in base.items():
        t.column(f)[:] = v
    for p, e in zip((FP8, FP4), err):
        for role in ("ex", "egy_d", "egy_w", "ex_w"):
            t.column(precision_field(role, p))[:] = e * 100.0 if role in ("ex", "ex_w") else e * 1e-2
        for role in ("ew", "ew_d"):
            t.column(precision_field(role, p))[:] = e * 10.0
        t.column(precision_field("gx_ex", p))[:] = 0.0
        t.column(precision_field("gw_ew", p))[:] = 0.0
        if measured:  # ||dY||^2 = (||E_X||^2 ||W||^2 + ||X||^2 ||E_W||^2) / k; <G_t, dY_t> of random alignment
            dy = (e * 100.0 * 10.0 + 100.0 * e * 10.0) / 16
            t.column(precision_field("dy_sq", p))[:] = dy
            t.column(precision_field("gdy_sq", p))[:] = dy * 1e-2 / (64 * 16)
    for f, rows in overrides.items():
        for i, v in rows.items():
            t.values[i, t.col(f)] = v
    return t


def test_bf16_costs_zero_and_candidates_positive():
    c = cost_table(make_table())
    for k in c.keys:
        assert c.costs[k][Precision.BF16] == 0.0
        assert 0 < c.costs[k][FP8] < c.costs[k][FP4]


def test_zero_quantization_error_costs_zero():
    c = cost_table(make_table(err=(0.0, 0.0)), EstimateConfig(lam=1.0, first_order=True))
    for k in c.keys:
        assert c.costs[k][FP8] == 0.0 and c.costs[k][FP4] == 0.0


def test_cost_grows_with_error():
    t = make_table()
    t.values[0, t.col("ex.fp4")] *= 4
    t.values[0, t.col("ew.fp4")] *= 4
    c = cost_table(t, EstimateConfig(lam=0.0, curvature="noise", output_error="model"))
    k0, k1 = t.keys[0], t.keys[1]
    assert c.loss_div[k0][FP4] == pytest.approx(4 * c.loss_div[k1][FP4])


def test_cost_grows_with_curvature():
    t = make_table(fwd_zg_noisy={1: 3 * 0.1 * 1000.0})
    c = cost_table(t, EstimateConfig(lam=0.0, curvature="noise", output_error="model"))
    assert c.kappa[t.keys[1]] == pytest.approx(3.0)
    assert c.costs[t.keys[1]][FP4] == pytest.approx(3 * c.costs[t.keys[0]][FP4])


def test_second_order_formula_by_hand():
    t = make_table()
    c = cost_table(t, EstimateConfig(lam=0.0, curvature="noise", output_error="model"))
    dy = (1e-2 * 100 * 10 + 100 * 1e-2 * 10) / 16  # (|E_X|^2 |W|^2 + |X|^2 |E_W|^2) / k
    assert c.loss_div[t.keys[0]][FP4] == pytest.approx(0.5 * 1.0 * dy / 2.0)


def test_negative_curvature_clamped_and_first_order_option():
    t = make_table(fwd_zg_noisy={0: -50.0})
    t.values[0, t.col("gx_ex.fp4")] = 1e-3
    assert cost_table(t, EstimateConfig(lam=0.0, curvature="noise", output_error="model")).costs[t.keys[0]][FP4] == 0.0
    c = cost_table(t, EstimateConfig(lam=0.0, first_order=True, curvature="noise", output_error="model"))
    assert c.costs[t.keys[0]][FP4] == pytest.approx(1e-3 / 2.0)


def test_weight_divergence_own_plus_propagated():
    t = make_table(num_layers=1)  # 4 linears
    a = 160.0 / 160.0
    own = (1e-2 * 1e-2 * 100 + 1e-2 * 1e-2 * 100) / 64
    up = (1e-2 * 1e-2 * 10 + 1e-2 * 1e-2 * 10) / 16
    wd = dv.weight_divergence(t, FP4)
    gain = dv.propagation_gain(t)
    # eta energy 1 per layer: layer j sees the noise of the (3 - j) later layers
    np.testing.assert_allclose(gain, [1 / 3, 1 / 2, 1.0, 0.0])
    before = np.concatenate([[0.0], np.cumsum(gain * a)[:-1]])
    np.testing.assert_allclose(wd, (a * own + up * before) / (4 * 50.0))
    assert wd[3] > wd[0]  # the last linear sends its error through every earlier layer


def test_weight_divergence_scales_with_adam_and_falls_back_without_state():
    t = make_table()
    t2 = make_table(adam_du_sq={i: 640.0 for i in range(8)}, adam_dv_sq={i: 64.0 for i in range(8)})
    for model in ("uniform", "proportional"):
        np.testing.assert_allclose(dv.weight_divergence(t2, FP4, model), 4 * dv.weight_divergence(t, FP4, model))
    # the models differ where small-v weights dominate the uniform mean
    t4 = make_table(adam_du_sq={0: 1600.0})
    assert dv.weight_divergence(t4, FP4, "uniform")[0] > 5 * dv.weight_divergence(t4, FP4, "proportional")[0]
    t3 = make_table(adam=False)
    wd = dv.weight_divergence(t3, FP4)
    assert np.isfinite(wd).all() and (wd > 0).all()


def test_lambda_adds_weight_divergence():
    t = make_table()
    c0, c1 = cost_table(t, EstimateConfig(lam=0.0, curvature="noise", output_error="model")), cost_table(t, EstimateConfig(lam=1.0, curvature="noise", output_error="model"))
    k = t.keys[0]
    assert c1.costs[k][FP4] == pytest.approx(c0.costs[k][FP4] + c1.weight_div[k][FP4])


def test_nonfinite_statistics_reported_per_layer_never_finite_costs():
    t = make_table(x_sq={2: math.nan}, bwd_eta_sq={5: math.inf})
    c = cost_table(t, EstimateConfig(lam=1.0))
    assert set(c.nonfinite) == {t.keys[2], t.keys[5]}
    assert c.nonfinite[t.keys[2]] == ["x_sq"]
    for i, k in enumerate(t.keys):
        if i in (2, 5):
            assert math.isnan(c.costs[k][FP4]) and math.isnan(c.costs[k][FP8])
        else:
            assert math.isfinite(c.costs[k][FP4]) and c.costs[k][FP4] > 0


def test_bad_loss_and_config_rejected():
    t = make_table()
    t.globals_["loss"] = 0.0
    with pytest.raises(ValueError, match="loss"):
        cost_table(t)
    with pytest.raises(ValueError, match="lam"):
        EstimateConfig(lam=-1)


def test_proxy_is_relative_error():
    t = make_table()
    p = proxy_table(t)
    assert p[t.keys[0]][FP4] == pytest.approx(1e-2 + 1e-2)
    assert p[t.keys[0]][Precision.BF16] == 0.0


def test_format_lists_every_layer():
    c = cost_table(make_table(x_sq={0: math.nan}))
    text = c.format()
    assert "1.linear_qkv" in text and "NONFINITE" in text and len(text.splitlines()) == 9


def test_fisher_and_mean_curvature():
    t = make_table()  # noise kappa 1; ||G_Y||^2 / m = 1e-2 / 16
    kf = 1e-2 / 16
    assert dv.curvature(t, kind="fisher")[0] == pytest.approx(kf)
    assert dv.curvature(t, kind="mean")[0] == pytest.approx(0.5 * (1.0 + kf))
    t2 = make_table(fwd_zg_noisy={0: -100.0})  # a negative noise estimate counts as 0 in the mean
    assert dv.curvature(t2, kind="mean")[0] == pytest.approx(0.5 * kf)
    c = cost_table(t, EstimateConfig(lam=0.0, curvature="fisher"))
    assert c.kappa[t.keys[0]] == pytest.approx(kf)
    with pytest.raises(ValueError, match="curvature"):
        EstimateConfig(curvature="nope")


def test_measured_output_error_and_fisher_along_the_error():
    t = make_table()
    for p in (FP8, FP4):
        t.column(precision_field("dy_sq", p))[:] = 3.0 if p is FP8 else 30.0
        t.column(precision_field("gdy_sq", p))[:] = 1e-5 if p is FP8 else 1e-3
    t.values[1, t.col("gdy_sq.fp4")] = 2e-3  # the second layer's error lies more along G_Y
    k = t.keys
    meas = cost_table(t, EstimateConfig(curvature="noise", output_error="measured"))
    assert meas.loss_div[k[0]][FP4] == pytest.approx(0.5 * 1.0 * 30.0 / 2.0)  # kappa 1, loss 2
    model = cost_table(t, EstimateConfig(curvature="noise", output_error="model"))
    assert model.loss_div[k[0]][FP4] == pytest.approx(0.5 * (1.0 * 10.0 + 100.0 * 0.1) / 16 / 2.0)
    ferr = cost_table(t, EstimateConfig(curvature="fisher_error"))
    assert ferr.loss_div[k[0]][FP4] == pytest.approx(0.5 * 64 * 1e-3 / 2.0)  # n = 64 tokens
    assert ferr.loss_div[k[1]][FP4] == pytest.approx(2 * ferr.loss_div[k[0]][FP4])
    assert 0 < ferr.loss_div[k[0]][FP8] < ferr.loss_div[k[0]][FP4]
    assert ferr.kappa[k[0]] == pytest.approx(1e-2 / 16)  # reported: the random-direction Fisher
    with pytest.raises(ValueError, match="output_error"):
        EstimateConfig(output_error="exact")


def test_a_table_without_measured_output_error_is_refused_where_needed():
    t = make_table(measured=False)  # quantization errors, but dy_sq / gdy_sq never measured
    for kind in ("fisher_error", "mean_error"):
        with pytest.raises(ValueError, match="no measured output error"):
            cost_table(t, EstimateConfig(curvature=kind, output_error="model"))
    with pytest.raises(ValueError, match="dy_sq.fp8"):
        cost_table(t, EstimateConfig(curvature="mean", output_error="measured"))
    cost_table(t, EstimateConfig(curvature="mean", output_error="model"))  # the model needs no dY
    zero = make_table(err=(0.0, 0.0))  # no error at all: nothing to miss
    assert cost_table(zero, EstimateConfig(curvature="mean_error")).costs[zero.keys[0]][FP4] == 0.0


def test_default_cost_grows_with_measured_error_and_with_curvature():
    t = make_table(fwd_zg_noisy={1: 3 * 0.1 * 1000.0})  # layer 1: noise curvature 3 instead of 1
    for f in ("dy_sq.fp4", "gdy_sq.fp4"):
        t.values[2, t.col(f)] *= 4  # layer 2: four times the output error
    c = cost_table(t)  # the default: mean of noise-kappa * ||dY||^2 and the Fisher along dY
    k = t.keys
    fisher = 64 * t.get(k[0], "gdy_sq.fp4")
    assert c.loss_div[k[0]][FP4] == pytest.approx(0.25 * (1.0 * t.get(k[0], "dy_sq.fp4") + fisher) / 2.0)
    assert c.loss_div[k[2]][FP4] == pytest.approx(4 * c.loss_div[k[0]][FP4])
    assert c.loss_div[k[1]][FP4] > 2 * c.loss_div[k[0]][FP4]
    assert 0 < c.costs[k[0]][FP8] < c.costs[k[0]][FP4]
