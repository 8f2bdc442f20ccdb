"""snip-analyze: which linears of a saved model could run in lower precision, and at what
predicted cost.

    snip-analyze --load CKPT --out DIR [--budgets 0.5,0.75,0.9] [--analyze-microbatches K] [-v]
                 <the run's own flags: Megatron-LM's (snip-pretrain-gpt; snip-pretrain-hybrid's with
                  --hybrid-layer-pattern) or the compact loop's>
    snip-analyze --recipe MODULE:FUNCTION --load CKPT --out DIR [...] [KEY=VALUE ...]
                 (a Megatron-Bridge checkpoint: the run's recipe and overrides, snip-bridge-pretrain's)
    torchrun --nproc-per-node N -m snip_megatron.analyze ...   (the run's layout: TP/PP/DP)

Loads the checkpoint at its step (Megatron-LM's, the compact loop's or Megatron-Bridge's: told apart
by the compact loop's manifest and Bridge's run_config.yaml), runs one SNIP measurement on K
micro-batches of the run's data at that step, solves SNIP's plan at every budget (the run's budget
kind: FP4 fractions, FP8 fractions where the run's GPU has no FP4, or speed-ups with --snip-budget
speedup), prints the table and writes into --out: each plan (JSON, pinnable with --snip-plan), its static recipes (`--te-precision-config-file`
YAML, Bridge `quant_recipe`), analysis.json / analysis.txt and analysis.png (predicted cost against
budget, with the last-fraction and first/last-k rules on the same measured costs). Nothing is
trained or written into the checkpoint. Bad input is one line and exit status 2, nothing written.
The loop's own output (Megatron's argument table, logs and warnings) is held back: `-v` shows it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snip_megatron.analyze.checkpoint import BRIDGE_RUN_CONFIG, which_loop

PROG = "snip-analyze"
DEFAULT_BUDGETS = "0.5,0.75,0.9"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Every other flag is the run's own (its model, layout and data).")
    p.add_argument("--load", required=True, metavar="DIR", help="the checkpoint folder (read only)")
    p.add_argument("--recipe", default=None, metavar="MODULE:FUNCTION",
                   help="a Megatron-Bridge checkpoint: the run's recipe (its overrides and snip.* follow as "
                        "KEY=VALUE, with --config-file YAML, as snip-bridge-pretrain takes them)")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="the checkpoint's step to analyze (default: the latest)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the plans, recipes and picture "
                                                              "(never inside --load)")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, metavar="B1,B2,...",
                   help="budgets to plan at, in the run's budget kind: FP4 (or FP8-or-lower) fractions of the "
                        f"linear FLOPs in [0, 1], or speed-ups >= 1 with --snip-budget speedup (default {DEFAULT_BUDGETS})")
    p.add_argument("--analyze-microbatches", type=int, default=8, metavar="K",
                   help="micro-batches of the run's global batch measured (default 8; at most the whole batch)")
    p.add_argument("--export-backend", default="te", choices=("te", "emulated"),
                   help="configs of the static recipes: Transformer Engine's (default) or SNIP's emulated linears'")
    p.add_argument("--export-sm", type=int, default=None, metavar="SM",
                   help="GPU compute capability of the TE recipes (default: the run's GPU, else 100)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the loop's own output as it comes (Megatron's argument table, its logs and warnings)")
    return p


def check_recipe(loop: str, recipe: "str | None", load: Path) -> None:
    """--recipe goes with a Megatron-Bridge checkpoint, and only with one."""
    if loop == "bridge" and recipe is None:
        raise ValueError(f"--load {load}: a Megatron-Bridge checkpoint ({BRIDGE_RUN_CONFIG} in its iteration "
                         "folder); give --recipe MODULE:FUNCTION, the run's recipe, and its overrides")
    if loop != "bridge" and recipe is not None:
        raise ValueError(f"--recipe {recipe}: --load {load} is not a Megatron-Bridge checkpoint (no "
                         f"{BRIDGE_RUN_CONFIG}); drop --recipe and give the run's own flags")


def check_out(out: Path, load: Path) -> None:
    out, load = out.resolve(), load.resolve()
    if out == load or load in out.parents:
        raise ValueError(f"--out {out} lies inside the checkpoint folder --load {load}: snip-analyze never writes "
                         "into a checkpoint; give another folder")


def main(argv: "list[str] | None" = None) -> int:
    from snip_megatron.analyze import plans
    from snip_megatron.analyze.quiet import held_output
    from snip_megatron.megatron.args import add_snip_args, snip_config_from_args

    ours, rest = build_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    budgets = plans.parse_budgets(ours.budgets)
    if ours.analyze_microbatches < 1:
        raise ValueError(f"--analyze-microbatches {ours.analyze_microbatches}: give a positive number")
    load, out = Path(ours.load), Path(ours.out)
    check_out(out, load)
    loop = which_loop(load, ours.ckpt_step)
    check_recipe(loop, ours.recipe, load)
    with held_output(ours.verbose):  # the loop's own output: shown with -v, or where it fails
        if loop == "bridge":  # Megatron-Bridge is imported for its checkpoints only (installed in its lane)
            from snip_megatron.analyze import bridge

            run = bridge.configure(ours.recipe, rest, load, ours.ckpt_step, ours.analyze_microbatches)
            plans.check_budgets(budgets, plans.budget_kind(run.snip))
            m = bridge.measure(run, ours.analyze_microbatches)
        else:
            # The run's --snip* flags, on their own: the budget kind the values are checked against.
            early = add_snip_args(argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False))
            plans.check_budgets(budgets, plans.budget_kind(snip_config_from_args(early.parse_known_args(rest)[0])))
            if loop == "compact":
                from snip_megatron.analyze.compact import measure
            else:
                from snip_megatron.analyze.megatron_lm import measure
            m = measure(rest, load, ours.ckpt_step, ours.analyze_microbatches)
    if m is None:  # --help
        return 0
    if m.is_writer:
        report(m, budgets, load, out, ours)
    m.close()
    return 0


def report(m, budgets: list, load: Path, out: Path, ours) -> None:
    """Global rank 0: solve every budget, print the table, write the files."""
    from snip_megatron.analyze import plans
    from snip_megatron.analyze.output import KIND_WORDS, table_text, write_all

    kind = plans.budget_kind(m.snip)
    plans.check_budgets(budgets, kind)  # the kind resolved for the run's GPU (FP8 fractions on Hopper)
    rows = plans.solve_budgets(m.stats, m.snip, budgets, m.controller_for)
    lowest = m.snip.plan_choices().precisions[-1]
    table = table_text(rows, kind, f"above {lowest.upper()}")
    sm = ours.export_sm or m.sm or 100
    print(f"[snip-analyze] {load} at step {m.step}: {m.measured} micro-batches measured in {m.seconds:.1f} s; "
          f"plans at {KIND_WORDS[kind]} budgets {', '.join(f'{b:g}' for b in budgets)} "
          f"(formats {m.snip.formats.short_str(m.snip.uses)})", flush=True)
    print(table, flush=True)
    doc = write_all(out, rows, kind, table, origin=str(load), step=m.step, measured=m.measured, pp=m.pp, vpp=m.vpp,
                    layout_error=m.layout_error, pattern=m.pattern,
                    backend=ours.export_backend, sm=sm, formats=m.snip.formats, measure_s=m.seconds)
    for p in doc["plans"]:  # a recipe the layout or the GPU cannot take: one line per budget
        why = next((w for w in p["files"].values() if w.startswith("not written")), None)
        if why is not None:
            print(f"[snip-analyze] budget {p['budget']:g}: static recipes {why}", flush=True)
    print(f"[snip-analyze] wrote {out}/: plan_*.json, te_precision_config_*.yaml, bridge_quant_recipe_*.yaml, "
          "analysis.json, analysis.txt, analysis.png", flush=True)


def cli() -> None:
    """Console entry point `snip-analyze`."""
    from snip_megatron.errors import run_cli

    sys.exit(run_cli(PROG, main))


if __name__ == "__main__":
    cli()
