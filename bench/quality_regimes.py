"""Where FP4 hurts: the quality benchmark's cheap comparison over quantized-phase lengths, model
widths (tokens per parameter) and FP4 formats.

Each regime is one bench/quality.py invocation: BF16, uniform FP4, the recipe (last_fraction, NVIDIA's
NVFP4 recipe: the last layers high) and SNIP periodic at 75%, NVFP4 and MXFP4, 2 seeds, from a shared
BF16 prefix. Per regime and format it reports the paired uniform-FP4 gap and the paired SNIP-minus-
recipe difference with their seed spreads, names the cheapest regime where uniform FP4 costs at least
1% and at least 10x its spread, or else the one where SNIP and the recipe separate most pair by pair
(|mean| / spread), and writes docs/quality_regimes.md (table and figure; bench/quality.py's report
includes it) and one results log per regime under docs/regimes/ (`--resume` is always on: a regime
whose runs are logged is read, not rerun).

    python bench/quality_regimes.py                  # every regime (about 2 hours on 2 cores)
    python bench/quality_regimes.py --only h64_q600  # one regime
    python bench/quality_regimes.py --report-only    # the report from the logs

Ends with `RESULT harsh=<regime> harsh_reason=<fp4_costs_1pct|most_separated> ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402

from snip_megatron.models import gpt  # noqa: E402

NARROW = ["--hidden", "64", "--ffn", "176", "--heads", "2", "--groups", "1"]
"""A quarter of the default width's linear parameters: more tokens per parameter at a step's cost."""
METHODS = "uniform_fp4,last_fraction,snip_periodic"
FORMATS = ("nvfp4", "mxfp4")
RECIPE = quality.RECIPES[0]  # last_fraction: NVIDIA's NVFP4 recipe, the last layers high


@dataclass(frozen=True)
class Regime:
    name: str
    flags: tuple
    """bench/quality.py flags of the model and schedule (the method set is the map's)."""
    run_dir: str = ""
    """Default runs/regimes/<name>; a regime read from another benchmark's log names its folder."""
    log: str = ""
    """Default docs/regimes/<name>.jsonl."""

    def argv(self, report_only: bool) -> list[str]:
        run_dir = self.run_dir or f"runs/regimes/{self.name}"
        return [*self.flags, "--methods", METHODS, "--budgets", "0.75", "--formats", ",".join(FORMATS),
                "--other-budgets", "0.75", "--seeds", "2", "--run-dir", run_dir,
                "--log", self.log or f"docs/regimes/{self.name}.jsonl",
                "--out", f"{run_dir}/results.md", "--resume"] \
            + (["--report-only"] if report_only else [])


REGIMES = (
    Regime("h128_q120", ("--steps", "520", "--prefix-steps", "400")),
    # The full benchmark's setting: its runs (bench/quality.py's log of the results in docs/results.md).
    Regime("h128_q300", ("--steps", "700", "--prefix-steps", "400"), run_dir="runs/quality"),
    Regime("h128_q700", ("--steps", "1100", "--prefix-steps", "400")),
    Regime("h64_q300", (*NARROW, "--steps", "700", "--prefix-steps", "400")),
    Regime("h64_q600", (*NARROW, "--steps", "3000", "--prefix-steps", "2400")),
    # Twice the tokens per parameter at the same quantized phase; twice the corpus, so no text repeats.
    Regime("h64_q600_long", (*NARROW, "--steps", "6000", "--prefix-steps", "5400", "--max-bytes", "12000000")),
)


def regime_row(regime: Regime, args, results: list[dict], fmt: str) -> dict:
    """The map's figures of one regime and format (relative gaps to the same seed's BF16)."""
    from snip_megatron.shapes import ModelShape

    summary = quality.summarize(results, fmt, [0.75], (RECIPE,))
    g = summary["gaps"]
    fp4 = g.get(("uniform_fp4", None), {})
    snip, recipe = g.get(("snip_periodic", 0.75), {}), g.get((RECIPE, 0.75), {})
    diff = [snip[s] - recipe[s] for s in snip if s in recipe]
    shape = ModelShape(**quality.common_settings(args)["model"])
    params = sum(o * i for o, i in gpt.linear_shapes(shape).values()) * shape.num_layers
    tokens = args.steps * args.micro_batch_size * args.seq
    minutes = sum(r["seconds"] for r in results if r["spec"]["fp4_recipe"] == fmt
                  or r["spec"]["method"] == "bf16") / 60
    return {
        "regime": regime.name, "format": fmt, "hidden": args.hidden, "steps": args.steps,
        "quantized_steps": args.steps - args.prefix_steps, "tokens_per_param": tokens / params,
        "fp4_gap": _mean(fp4.values()), "fp4_spread": _spread(fp4.values()),
        "snip_gap": _mean(snip.values()), "recipe_gap": _mean(recipe.values()),
        "snip_minus_recipe": _mean(diff), "snip_minus_recipe_spread": _spread(diff),
        "seeds": min(len(fp4), len(diff)), "process_minutes": minutes,
    }


def _mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else math.nan


def _spread(xs) -> float:
    xs = list(xs)
    return statistics.pstdev(xs) if len(xs) > 1 else math.nan


def harsh_regime(rows: list[dict]) -> tuple[str | None, str]:
    """The cheapest regime (process-minutes) where uniform FP4 costs >= 1% and >= 10x its spread in some
    format; else the one where SNIP and the recipe separate most pair by pair (|mean| / spread)."""
    costly = [r for r in rows if r["fp4_gap"] >= 0.01 and r["fp4_gap"] >= 10 * r["fp4_spread"]]
    if costly:
        return min(costly, key=lambda r: r["process_minutes"])["regime"], "fp4_costs_1pct"
    scored = [(abs(r["snip_minus_recipe"]) / max(r["snip_minus_recipe_spread"], 1e-12), r["regime"])
              for r in rows if not math.isnan(r["snip_minus_recipe"]) and not math.isnan(r["snip_minus_recipe_spread"])]
    return (max(scored)[1], "most_separated") if scored else (None, "none")


def format_rows(rows: list[dict]) -> str:
    lines = ["| regime | width | quantized steps | tokens per linear parameter | format | uniform FP4 gap "
             "(mean ± spread) | recipe gap | SNIP gap | SNIP minus recipe, paired (mean ± spread) | seeds | "
             "process-minutes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['regime']} | {r['hidden']} | {r['quantized_steps']} | {r['tokens_per_param']:.2f} | "
                     f"{r['format']} | {r['fp4_gap']:+.3%} ± {r['fp4_spread']:.3%} | {r['recipe_gap']:+.3%} | "
                     f"{r['snip_gap']:+.3%} | {r['snip_minus_recipe']:+.3%} ± {r['snip_minus_recipe_spread']:.3%} | "
                     f"{r['seeds']} | {r['process_minutes']:.0f} |")
    return "\n".join(lines)


def draw(rows: list[dict], out: Path) -> Path:
    """Both figures against tokens per linear parameter (log), each point labelled by its quantized steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (fmt, hidden), marker in zip([(f, h) for f in FORMATS for h in (128, 64)], "osD^"):
        sel = sorted((r for r in rows if r["format"] == fmt and r["hidden"] == hidden),
                     key=lambda r: r["tokens_per_param"])
        if not sel:
            continue
        x = [r["tokens_per_param"] for r in sel]
        for ax, key in zip(axes, ("fp4_gap", "snip_minus_recipe")):
            y = [100 * r[key] for r in sel]
            ax.errorbar(x, y, yerr=[100 * r[key.replace("_gap", "") + "_spread"] for r in sel], marker=marker,
                        capsize=3, label=f"{fmt}, hidden {hidden}")
            for xi, yi, r in zip(x, y, sel):
                ax.annotate(f"{r['quantized_steps']}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                            fontsize=6)
    axes[0].set_title("uniform FP4, gap to BF16 (paired)")
    axes[1].set_title(f"SNIP periodic minus {RECIPE} at 75% (paired)")
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("tokens per linear parameter (labels: quantized steps)")
        ax.set_ylabel("relative validation-loss gap (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=None, help="comma list of regimes to run (the report covers every logged one)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--jobs", default="2")
    p.add_argument("--out", default=str(ROOT / "docs" / "quality_regimes.md"))
    args = p.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else {r.name for r in REGIMES}
    unknown = wanted - {r.name for r in REGIMES}
    if unknown:
        p.error(f"--only: unknown regime(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(r.name for r in REGIMES)}")
    rows, start = [], time.perf_counter()
    for regime in REGIMES:
        run = regime.name in wanted and not args.report_only
        log = ROOT / (regime.log or f"docs/regimes/{regime.name}.jsonl")
        if not run and not log.exists():
            continue
        qargs = quality.parse_args(regime.argv(report_only=not run) + ["--jobs", args.jobs])
        if run:
            print(f"== regime {regime.name}", flush=True)
            quality.main(qargs.argv)
        results = quality.load_finished(log, quality.build_specs(qargs))
        rows += [regime_row(regime, qargs, results, fmt) for fmt in FORMATS]
    harsh, reason = harsh_regime(rows)
    out = Path(args.out)
    figure = draw(rows, out.with_suffix(".png")) if rows else None
    text = ["## Where FP4 hurts (written by `bench/quality_regimes.py`)", "",
            "Each regime: BF16, uniform FP4, the recipe (last_fraction) and SNIP periodic at 75%, 2 seeds, from "
            "a shared BF16 prefix (bench/quality.py with `--methods uniform_fp4,last_fraction,snip_periodic`). "
            "Gaps are relative validation-loss gaps to the same seed's BF16 run (final weights evaluated in "
            "BF16); spreads are over seeds; tokens per linear parameter count every step, the prefix included.",
            "", format_rows(rows), ""]
    if figure:
        text += [f"![where FP4 hurts]({figure.name})", ""]
    text += [{"fp4_costs_1pct": f"Cheapest regime where uniform FP4 costs at least 1% and 10x its spread: **{harsh}**.",
              "most_separated": f"No regime here makes uniform FP4 cost 1% (and 10x its spread); the regime where "
                                f"SNIP and the recipe separate most pair by pair: **{harsh}**.",
              "none": "No regime has both seeds yet."}[reason], ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    print(format_rows(rows))
    print(f"wrote {out} ({(time.perf_counter() - start) / 60:.1f} min)")
    worst = max(rows, key=lambda r: r["fp4_gap"], default=None)
    print(f"RESULT harsh={harsh} harsh_reason={reason} regimes={len({r['regime'] for r in rows})} "
          + (f"max_fp4_gap={worst['fp4_gap']:.5f} max_fp4_gap_at={worst['regime']}_{worst['format']}" if worst else ""))


if __name__ == "__main__":
    main()
