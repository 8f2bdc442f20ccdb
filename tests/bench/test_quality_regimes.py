"""bench/quality_regimes.py: every regime is a valid quality benchmark, and the choice of the harsh one."""

import math


def test_every_regime_runs_the_maps_methods_in_both_formats(regimes):
    assert len({r.name for r in regimes.REGIMES}) == len(regimes.REGIMES)
    for regime in regimes.REGIMES:
        args = regimes.quality.parse_args(regime.argv(report_only=True))
        specs = regimes.quality.build_specs(args)
        # per seed: BF16, then uniform FP4, the recipe and SNIP at 75% in each format; no oracle
        assert len(specs) == 2 * (1 + 2 * 3), regime.name
        assert {s.method for s in specs} == {"bf16", "uniform_fp4", "last_fraction", "snip_periodic"}
        assert args.resume and args.log.startswith("docs/regimes/") and args.log.endswith(f"{regime.name}.jsonl")


def _row(name, gap, spread, diff, diff_spread, minutes):
    return {"regime": name, "fp4_gap": gap, "fp4_spread": spread, "snip_minus_recipe": diff,
            "snip_minus_recipe_spread": diff_spread, "process_minutes": minutes}


def test_the_harsh_regime_is_the_cheapest_where_fp4_costs_a_clear_percent(regimes):
    rows = [_row("a", 0.012, 0.002, -0.001, 0.001, 10),   # 1.2% but only 6x its spread
            _row("b", 0.011, 0.001, -0.001, 0.001, 50),
            _row("c", 0.020, 0.001, -0.001, 0.001, 30)]
    assert regimes.harsh_regime(rows) == ("c", "fp4_costs_1pct")
    # none costs 1%: the regime where SNIP and the recipe separate most, in spreads
    rows = [_row("a", 0.002, 0.001, -0.004, 0.002, 10), _row("b", 0.003, 0.001, -0.001, 0.0001, 20),
            _row("c", 0.001, 0.001, math.nan, math.nan, 5)]
    assert regimes.harsh_regime(rows) == ("b", "most_separated")
    assert regimes.harsh_regime([]) == (None, "none")
