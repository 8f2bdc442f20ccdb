"""SNIP's command-line flags for Megatron-LM (`extra_args_provider`) and the SnipConfig they make.

    from snip_megatron.megatron import add_snip_args
    args = parse_and_validate_args(extra_args_provider=add_snip_args)
    snip = snip_config_from_args(args)

Import-light on purpose (argparse and the config only), so a Megatron-LM checkout can import it
before torch or Megatron are initialised.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from snip_megatron.config import BASELINES, FP4_RECIPES, FP8_RECIPES, PRECISIONS, SnipConfig

_DEFAULTS = SnipConfig()

# SnipConfig field -> the flag that sets it, so a config error names what the user typed.
FIELD_TO_FLAG = {
    "enabled": "--snip",
    "fp4_budget": "--snip-fp4-budget",
    "interval": "--snip-interval",
    "lag": "--snip-lag",
    "warmup": "--snip-warmup",
    "precisions": "--snip-precisions",
    "fp8_recipe": "--snip-fp8-recipe",
    "fp4_recipe": "--snip-fp4-recipe",
    "per_stage_budget": "--snip-per-stage-budget",
    "plan": "--snip-plan",
    "pin_plan": "--snip-pin-plan",
    "baseline": "--snip-baseline",
    "baseline_k": "--snip-baseline-k",
    "baseline_fraction": "--snip-baseline-fraction",
    "baseline_relax": "--snip-baseline-relax",
    "initial_precision": "--snip-initial-precision",
    "lambda_wd": "--snip-lambda-wd",
    "switch_penalty": "--snip-switch-penalty",
    "solver_time_limit_s": "--snip-solver-time-limit",
    "solver_gap": "--snip-solver-gap",
    "noise_scale": "--snip-noise-scale",
    "loss_guard_factor": "--snip-loss-guard-factor",
    "loss_guard_window": "--snip-loss-guard-window",
    "seed": "--snip-seed",
}


def _dest(field_name: str) -> str:
    return FIELD_TO_FLAG[field_name][2:].replace("-", "_")


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _warmup(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction of the run (< 1) or a step count (>= 1), got {text!r}") from None
    if v < 0 or (v >= 1 and v != int(v)):
        raise argparse.ArgumentTypeError(
            f"expected a fraction of the run (< 1) or a whole step count (>= 1), got {text!r}")
    return v


def _precisions(text: str) -> list[str]:
    try:
        return SnipConfig._check_precisions(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("SnipConfig.precisions", "precision list")) from None


def add_snip_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--snip*` flags to Megatron's parser (its `extra_args_provider`); returns the parser."""
    d = _DEFAULTS
    g = parser.add_argument_group(title="SNIP", description="adaptive per-layer FP8/FP4 precision")
    g.add_argument("--snip", action="store_true", dest=_dest("enabled"),
                   help="Plan each linear layer's precision with SNIP (off: plain run).")
    g.add_argument("--snip-fp4-budget", type=_fraction, default=d.fp4_budget, dest=_dest("fp4_budget"),
                   help=f"Fraction of linear FLOPs in FP4, in [0, 1] (default {d.fp4_budget}).")
    g.add_argument("--snip-interval", type=_positive_int, default=d.interval, dest=_dest("interval"),
                   help=f"Steps between two measurements (default {d.interval}).")
    g.add_argument("--snip-lag", type=_non_negative_int, default=d.lag, dest=_dest("lag"),
                   help=f"Steps from a measurement to applying its plan (default {d.lag}).")
    g.add_argument("--snip-warmup", type=_warmup, default=d.warmup, dest=_dest("warmup"),
                   help="Steps before the first measurement: a fraction of --train-iters if < 1, "
                        f"else a step count (default {d.warmup}).")
    g.add_argument("--snip-precisions", type=_precisions, default=list(d.precisions),
                   dest=_dest("precisions"),
                   help=f"Comma list of precisions to choose from, of {','.join(PRECISIONS)} "
                        f"(default {','.join(d.precisions)}).")
    g.add_argument("--snip-fp8-recipe", choices=FP8_RECIPES, default=d.fp8_recipe, dest=_dest("fp8_recipe"),
                   help=f"FP8 format (default {d.fp8_recipe}).")
    g.add_argument("--snip-fp4-recipe", choices=FP4_RECIPES, default=d.fp4_recipe, dest=_dest("fp4_recipe"),
                   help=f"FP4 format (default {d.fp4_recipe}).")
    g.add_argument("--snip-per-stage-budget", action="store_true", dest=_dest("per_stage_budget"),
                   help="Enforce the FP4 budget on every pipeline stage.")
    g.add_argument("--snip-plan", type=str, default=None, dest=_dest("plan"), metavar="PATH",
                   help="Start from this saved plan (JSON/YAML); with --snip-pin-plan, keep it all run.")
    g.add_argument("--snip-pin-plan", action="store_true", dest=_dest("pin_plan"),
                   help="Never re-plan: run --snip-plan for the whole run.")
    g.add_argument("--snip-baseline", choices=BASELINES, default=None, dest=_dest("baseline"),
                   help="Run this fixed-rule baseline plan instead of SNIP's measured one.")
    g.add_argument("--snip-baseline-k", type=_positive_int, default=d.baseline_k, dest=_dest("baseline_k"),
                   help=f"first_last_k: layers kept out of FP4 at each end (default {d.baseline_k}).")
    g.add_argument("--snip-baseline-fraction", type=_fraction, default=d.baseline_fraction,
                   dest=_dest("baseline_fraction"),
                   help=f"last_fraction: fraction of final layers kept out of FP4 (default {d.baseline_fraction}).")
    g.add_argument("--snip-baseline-relax", action="store_true", dest=_dest("baseline_relax"),
                   help="Where a baseline keeps too many linears high for the budget, give them FP4 last.")
    g.add_argument("--snip-initial-precision", choices=PRECISIONS, default=d.initial_precision,
                   dest=_dest("initial_precision"),
                   help=f"Precision of every planned linear before the first plan (default {d.initial_precision}).")
    g.add_argument("--snip-lambda-wd", type=float, default=d.lambda_wd, dest=_dest("lambda_wd"),
                   help=f"Weight of the weight-divergence term (default {d.lambda_wd}).")
    g.add_argument("--snip-switch-penalty", type=float, default=d.switch_penalty, dest=_dest("switch_penalty"),
                   help=f"Cost of changing a layer's precision (default {d.switch_penalty}).")
    g.add_argument("--snip-solver-time-limit", type=float, default=d.solver_time_limit_s,
                   dest=_dest("solver_time_limit_s"), metavar="SECONDS",
                   help=f"ILP time limit (default {d.solver_time_limit_s} s).")
    g.add_argument("--snip-solver-gap", type=float, default=d.solver_gap, dest=_dest("solver_gap"),
                   help=f"ILP relative optimality gap (default {d.solver_gap}).")
    g.add_argument("--snip-noise-scale", type=float, default=d.noise_scale, dest=_dest("noise_scale"),
                   help=f"Noise std of the noise passes, fraction of rms (default {d.noise_scale}).")
    g.add_argument("--snip-loss-guard-factor", type=float, default=d.loss_guard_factor,
                   dest=_dest("loss_guard_factor"),
                   help="Revert a plan whose loss exceeds this factor times the recent mean (0: off).")
    g.add_argument("--snip-loss-guard-window", type=_positive_int, default=d.loss_guard_window,
                   dest=_dest("loss_guard_window"),
                   help=f"Steps of loss history for the loss guard (default {d.loss_guard_window}).")
    g.add_argument("--snip-seed", type=_non_negative_int, default=d.seed, dest=_dest("seed"),
                   help=f"Seed of the noise passes and the random baseline (default {d.seed}).")
    return parser


def snip_config_from_args(args: argparse.Namespace) -> SnipConfig:
    """SnipConfig from parsed flags; a bad combination raises ValueError naming the flag(s).

    `--snip-plan` or `--snip-baseline` without `--snip` still enables SNIP's layers: asking for a
    plan is asking to run it.
    """
    values = {f.name: getattr(args, _dest(f.name)) for f in fields(SnipConfig)}
    if values["plan"] is not None or values["baseline"] is not None:
        values["enabled"] = True
    try:
        return SnipConfig(**values)
    except ValueError as e:
        msg = str(e)
        for name in sorted(FIELD_TO_FLAG, key=len, reverse=True):  # baseline_k before baseline
            msg = msg.replace(f"SnipConfig.{name}", FIELD_TO_FLAG[name])
        raise ValueError(f"bad SNIP flags: {msg}") from None


def snip_args_from_config(cfg: SnipConfig) -> list[str]:
    """The flags that reproduce `cfg` (only those that differ from the defaults), for launch lines."""
    if not cfg.enabled:
        return []
    out = ["--snip"]
    for f in fields(SnipConfig):
        if f.name == "enabled":
            continue
        v, default = getattr(cfg, f.name), getattr(_DEFAULTS, f.name)
        if f.name == "precisions":
            v, default = list(v), list(default)
        if v == default:
            continue
        flag = FIELD_TO_FLAG[f.name]
        if isinstance(v, bool):
            out.append(flag)
        elif isinstance(v, list):
            out += [flag, ",".join(v)]
        elif isinstance(v, float) and v == int(v) and f.name == "warmup":
            out += [flag, str(int(v))]
        else:
            out += [flag, str(v)]
    return out
