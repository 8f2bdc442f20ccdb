"""bench/estimator_fidelity.py scoring: Spearman with ties, the scores of a result, rescoring a saved run."""

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_spearman_ranks_with_ties_and_drops_nan(fidelity):
    assert fidelity.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fidelity.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert fidelity.spearman([1, 1, 2, 3], [5, 5, 6, 7]) == pytest.approx(1.0)  # tied ranks shared
    assert fidelity.spearman([1, 2, math.nan, 3, 4], [1, 2, 99, 3, 4]) == pytest.approx(1.0)
    assert math.isnan(fidelity.spearman([1, 2], [1, 2]))


def _result(n=6, seed=0):
    """A result dict with a prediction that ranks FP4 harm perfectly and a noisy second batch."""
    rng = np.random.default_rng(seed)
    harm4 = np.linspace(1.0, 6.0, n)
    harm8 = harm4 / 10
    pred = {p: {"dL": list(h), "WD": list(h), "Q0.0": list(h), "dL_alt": list(-h)}
            for p, h in (("fp4", harm4), ("fp8", harm8))}
    noisy = {p: {k: list(np.array(v) + rng.normal(0, 5, n)) for k, v in d.items()} for p, d in pred.items()}
    return {
        "harm": {"fp4": [[h, h] for h in harm4], "fp8": [[h, h] for h in harm8]},
        "dev": {"fp4": list(harm4), "fp8": list(harm8)},
        "dev_seeds": {"fp4": [[h, h] for h in harm4]},
        "pred": pred, "extra_pred": [noisy],
        "proxy": {"fp4": list(-harm4), "fp8": list(-harm8)},
        "kappa": [1.0] * n,
        "probe": {p: {"batch": list(h), "secant": list(h), "secant_sign": list(h), "joint_sign": list(-h)}
                  for p, h in (("fp4", harm4), ("fp8", harm8))},
    }


def test_scores_of_a_result(fidelity):
    s = fidelity.scores(_result(), [0.0], 0.0)
    assert s["fp4"] == pytest.approx(1.0) and s["marginal"] == pytest.approx(1.0)
    assert s["fp4_alt"] == pytest.approx(-1.0)  # every dL_ variant is scored
    assert s["proxy_fp4"] == pytest.approx(-1.0)
    assert s["ceiling_split"] == pytest.approx(1.0) and s["ceiling_wd"] == pytest.approx(1.0)
    assert s["wd"] == pytest.approx(1.0)
    assert s["probe_fp4_secant"] == pytest.approx(1.0) and s["probe_fp4_joint_sign"] == pytest.approx(-1.0)
    assert -1.0 <= s["batch_split_dL"] < 1.0  # the second batch is noisy
    assert "long" not in s  # no long-horizon truth in this result


def test_rescore_a_saved_run(fidelity, capsys):
    fidelity.main(["--rescore", str(ROOT / "docs" / "fidelity" / "nv4.json")])
    out = capsys.readouterr().out
    result = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(result) == 1
    values = dict(kv.split("=") for kv in result[0].split()[1:])
    assert set(values) == {"spearman_fp4", "spearman_marginal", "spearman_long", "spearman_wd",
                           "spearman_proxy", "ceiling_split", "ceiling_long"}
    for v in values.values():
        assert -1.0 <= float(v) <= 1.0
    # the truth side does not depend on the estimator: the recorded run's ceilings
    assert float(values["ceiling_split"]) == pytest.approx(0.894, abs=1e-3)
    assert float(values["ceiling_long"]) == pytest.approx(0.323, abs=1e-3)


def test_second_order_part_of_the_truth(fidelity):
    """harm = first order + second order: an estimate that ranks the second-order part perfectly
    scores 1 against it even where the first-order part scrambles the harm's ranking."""
    r = _result(n=8)
    so4 = np.linspace(1.0, 8.0, 8)
    fo4 = np.array([6.0, -3.0, 4.0, -5.0, 2.0, -6.0, 1.0, -2.0])  # as large as the signal, either sign
    r["harm"] = {"fp4": [[h, h] for h in so4 + fo4], "fp8": [[h, h] for h in (so4 + fo4) / 10]}
    r["first_order"] = {"fp4": [[f, f] for f in fo4], "fp8": [[f, f] for f in fo4 / 10]}
    r["pred"] = {p: dict(r["pred"][p], dL=list(so4 / d)) for p, d in (("fp4", 1), ("fp8", 10))}
    s = fidelity.scores(r, [0.0], 0.0)
    assert s["fp4_second_order"] == pytest.approx(1.0) and s["marginal_second_order"] == pytest.approx(1.0)
    assert s["fp4"] < 0.8  # scored against the whole harm
    assert s["ceiling_second_order"] == pytest.approx(s["fp4"])  # the estimate is the second-order part
    assert s["first_order_share"] == pytest.approx(np.abs(fo4).sum() / np.abs(so4 + fo4).sum())


def test_other_evaluation_sets_are_reported(fidelity, capsys):
    r = _result()
    r["eval_set"] = "iid"
    r["other_sets"] = {"docs": {"harm": {p: [[-a, -b] for a, b in v] for p, v in r["harm"].items()},
                                "base_val": [3.0, 3.0]}}
    fidelity.report([str(i) for i in range(6)], {"later": r},
                    fidelity.argparse.Namespace(lambdas=[0.0], fp4_recipe="nvfp4"))
    out = capsys.readouterr().out
    docs = [line for line in out.splitlines() if line.startswith("against the docs truth")]
    assert len(docs) == 1 and "spearman_fp4=-1.000" in docs[0]  # the docs truth is the reverse
    assert out.splitlines()[-1].startswith("RESULT spearman_fp4=1.000")  # RESULT: the primary set


def test_cache_path_depends_on_training_arguments_only(fidelity):
    ap = fidelity.argparse.Namespace
    base = dict(steps=1000, early=300, mbs=8, num_mb=4, lr=3e-3, seed=1, long_steps=60, pred_batches=2,
                points="later", cache_dir="c", fp4_recipe="nvfp4")
    a = fidelity.cache_path(ap(**base), "later")
    assert fidelity.cache_path(ap(**dict(base, fp4_recipe="mxfp4")), "later") == a
    assert fidelity.cache_path(ap(**dict(base, steps=900)), "later") != a
    assert fidelity.cache_path(ap(**base), "early") != a
    assert fidelity.cache_path(ap(**dict(base, cache_dir=None)), "later") is None


def test_remeasure_needs_the_cached_model(fidelity, tmp_path):
    with pytest.raises(SystemExit, match="--cache-dir"):
        fidelity.main(["--remeasure", str(ROOT / "docs" / "fidelity" / "nv4.json"), "--cache-dir", str(tmp_path)])


def test_long_horizon_ceiling_from_halves_of_the_data_orders(fidelity):
    r = _result()
    base = np.linspace(1.0, 6.0, 6)
    rows = np.stack([base, 2 * base, base ** 2, base + 1], axis=1)  # four orders, the same ranking
    r["long"] = {"fp4": rows.tolist()}
    s = fidelity.scores(r, [0.0], 0.0)
    assert s["ceiling_long"] == pytest.approx(1.0)  # mean of orders 0,1 vs mean of orders 2,3
    rows[:, 2:] = np.stack([base[::-1], base[::-1]], axis=1)
    r["long"] = {"fp4": rows.tolist()}
    assert fidelity.scores(r, [0.0], 0.0)["ceiling_long"] == pytest.approx(-1.0)


def _long_run(orders, bases, value):
    """The long-horizon part of a saved run: 3 layers, the listed orders, every harm = value(order)."""
    rows = [[value(o) * (i + 1) for o in orders] for i in range(3)]
    return {"long": {"fp4": rows}, "long_base": bases, "long_orders": list(orders),
            "other_sets": {"docs": {"long": {"fp4": [[-x for x in r] for r in rows]}}}}


def test_merge_long_appends_the_orders_of_a_skipping_run(fidelity):
    bases = [3.1, 3.2, 3.3, 3.4]
    first = _long_run([0, 1], bases[:2], float)
    first.pop("long_orders")  # runs saved before --long-skip: every order they drew
    fidelity.merge_long(first, _long_run([2, 3], bases, float), "extra.json")
    assert first["long_orders"] == [0, 1, 2, 3] and first["long_base"] == bases
    assert first["long"]["fp4"][1] == [0.0, 2.0, 4.0, 6.0]
    assert first["other_sets"]["docs"]["long"]["fp4"][2] == [-0.0, -3.0, -6.0, -9.0]


def test_merge_long_refuses_other_data_or_the_same_order_twice(fidelity):
    with pytest.raises(SystemExit, match="order 1's BF16 continuation differs"):
        fidelity.merge_long(_long_run([0, 1], [3.1, 3.2], float),
                            _long_run([2, 3], [3.1, 3.25, 3.3, 3.4], float), "extra.json")
    with pytest.raises(SystemExit, match=r"orders \[1\] are in both runs"):
        fidelity.merge_long(_long_run([0, 1], [3.1, 3.2], float),
                            _long_run([1, 2], [3.1, 3.2, 3.3], float), "extra.json")


def test_long_from_and_long_skip_are_checked(fidelity):
    with pytest.raises(SystemExit):
        fidelity.main(["--long-from", "other.json"])  # without --rescore it would be ignored
    with pytest.raises(SystemExit):
        fidelity.main(["--long-orders", "2", "--long-skip", "2"])


def test_merge_long_refuses_other_layers_or_precisions(fidelity):
    extra = _long_run([2, 3], [3.1, 3.2, 3.3, 3.4], float)
    extra["long"]["fp4"] = extra["long"]["fp4"][:2]  # a model with fewer layers
    with pytest.raises(SystemExit, match="other precisions or layers"):
        fidelity.merge_long(_long_run([0, 1], [3.1, 3.2], float), extra, "extra.json")
    extra = _long_run([2, 3], [3.1, 3.2, 3.3, 3.4], float)
    extra["long"]["fp8"] = extra["long"]["fp4"]
    with pytest.raises(SystemExit, match="other precisions or layers"):
        fidelity.merge_long(_long_run([0, 1], [3.1, 3.2], float), extra, "extra.json")


def test_moe_units_are_scored_by_kind(fidelity, capsys):
    """An MoE model's RESULT adds the Spearman over its routed-expert units and over its attention
    linears apart (llama_tiny_moe8: every layer MoE, 12 of each), each ranked within its kind."""
    from snip_megatron.train.config import TrainConfig

    groups = fidelity.unit_groups(TrainConfig(model="llama_tiny_moe8").inventory)
    keys = list(groups)
    assert sum(g == "experts" for g in groups.values()) == 12 and sum(g == "attention" for g in groups.values()) == 12
    assert {groups["1.expert_fc1"], groups["6.expert_fc2"], groups["3.linear_qkv"]} == {"experts", "attention"}
    r = _result(n=len(keys))
    experts = [i for i, k in enumerate(keys) if groups[k] == "experts"]
    for i in experts:  # the predictions rank the experts backwards, the attention linears right
        r["pred"]["fp4"]["dL"][i] = -r["pred"]["fp4"]["dL"][i]
    r["harm_frozen"] = [[-h, -h] if i in experts else [h, h] for i, (h, _) in enumerate(r["harm"]["fp4"])]
    gs = fidelity.group_scores(keys, r, groups)
    assert gs["fp4_experts"] == pytest.approx(-1.0) and gs["fp4_attention"] == pytest.approx(1.0)
    assert not any(k.startswith("fp4_avg_") for k in fidelity.group_scores(keys, dict(r, extra_pred=[]), groups))
    # more measured batches: their mean prediction (two more that rank the experts right outweigh it)
    right = [abs(v) for v in r["pred"]["fp4"]["dL"]]
    averaged = dict(r, extra_pred=[{"fp4": {"dL": [3 * v for v in right]}}] * 2)
    gs_avg = fidelity.group_scores(keys, averaged, groups)
    assert gs_avg["fp4_avg_experts"] == pytest.approx(1.0) and gs_avg["fp4_experts"] == pytest.approx(-1.0)
    # against the harm with routing frozen (here: the experts' reversed) and how it ranks against the free one
    assert gs["fp4_frozen_routing_experts"] == pytest.approx(1.0) and gs["frozen_vs_free_experts"] == pytest.approx(-1.0)
    assert gs["units_experts"] == gs["units_attention"] == 12 and gs["ceiling_split_experts"] == pytest.approx(1.0)
    fidelity.report(keys, {"later": r}, SimpleNamespace(lambdas=[0.0], fp4_recipe="nvfp4"), groups)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = dict(kv.split("=") for kv in last.split()[1:])
    assert float(values["spearman_fp4_experts"]) == pytest.approx(-1.0)
    assert float(values["spearman_fp4_attention"]) == pytest.approx(1.0)
    assert {"ceiling_split_experts", "ceiling_split_attention"} <= set(values)
    assert float(values["spearman_fp4_frozen_routing_experts"]) == pytest.approx(1.0)
    # a dense model's RESULT keeps its fields
    dense = {k: ("attention" if g == "experts" else g) for k, g in groups.items()}
    fidelity.report(keys, {"later": r}, SimpleNamespace(lambdas=[0.0], fp4_recipe="nvfp4"), dense)
    assert "spearman_fp4_attention" not in capsys.readouterr().out.strip().splitlines()[-1]
    with pytest.raises(SystemExit):  # the probe injects one tensor per module: refused for experts
        fidelity.main(["--model", "llama_tiny_moe8", "--probe"])


def test_rescore_the_moe_run_keeps_its_kinds_of_unit(fidelity, capsys):
    """docs/fidelity/moe8.json (llama_tiny_moe8, docs/results.md): rescored, its RESULT scores the
    routed experts and the attention linears apart, with the recorded truths' ceilings."""
    fidelity.main(["--rescore", str(ROOT / "docs" / "fidelity" / "moe8.json")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = {k: float(v) for k, v in (kv.split("=") for kv in last.split()[1:])}
    assert {"spearman_fp4_experts", "spearman_fp4_attention"} <= set(values)
    assert values["ceiling_split_experts"] == pytest.approx(0.818, abs=1e-3)
    assert values["ceiling_split_attention"] == pytest.approx(0.406, abs=1e-3)
