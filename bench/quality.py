"""Quality at equal FP4 budgets: SNIP against uniform precision and the fixed heuristics.

Every method trains the same model on the same data for the same steps; a given seed feeds the same
weights and data order to every method, so gaps are compared pair by pair. Every method runs the
same initial plan (all planned linears in FP8) until the warm-up measurement; BF16 runs BF16
throughout. Runs go in parallel processes (one thread each). Heuristics whose kept-high linears
leave less than the budget are relaxed (SnipConfig.baseline_relax: the kept linears get FP4 last),
so every method runs at the same FP4 budget. BF16 and uniform FP8 do not depend on the FP4 format
and run once per seed.

    python bench/quality.py --quick   # main format, budgets 75/80, 3 heuristics, 2 seeds (~10 min)
    python bench/quality.py           # main format (NVFP4): budgets 50/75/80/90, the other (MXFP4):
                                      # 75/80/90; every method and the oracle, 3 seeds (~4 h)

Every seed trains its first `--prefix-steps` (default 400 of 700) once, in BF16, checkpoints them,
and every method continues from that checkpoint (SNIP applied to a pretrained checkpoint, the
paper's setting): the methods then differ only in the steps after it, and BF16 shares the prefix
too, so each gap is the cost of the quantized steps alone, not the trajectory noise of runs that
differ from step 0. `--prefix-steps 0` trains every method from step 0 (all FP8 until the
warm-up measurement at 20% of the run).

Each finished run is appended to <run-dir>/results.jsonl, and each invocation that ran something
adds a record of its wall time; `--resume` skips the runs found there (same settings), so an
interrupted benchmark continues where it stopped, and `--report-only` rewrites the report from the
log (a log with finished runs is only replaced with `--fresh`). `--methods` runs a subset (e.g.
`--methods snip_once,snip_periodic --seeds 8` for more seeds of one comparison; BF16 always runs,
every gap is taken to it).

The full benchmark (and `--methods ...,oracle`) also runs the oracle (bench/quality_oracle.py): each
planned linear alone in FP4 from the seed's prefix checkpoint (24 runs per seed and format), then,
as soon as a seed's singles are in, the knapsack over their harms at each budget, trained pinned.

Writes docs/results.md (tables, the oracle comparison and single-linear harms, loss curves, the SNIP
plan heat map, the command, machine, wall time; and bench/quality_regimes.py's map of where FP4
hurts when docs/quality_regimes.md exists) and ends with
`RESULT snip_gap_75=.. best_baseline_gap_75=.. recipe_gap_75=.. snip_gap_80=.. best_baseline_gap_80=..
recipe_gap_80=.. uniform_fp4_gap=.. noise=.. oracle_gap_75=.. oracle_share_75=.. oracle_share_80=..`
for the main format (relative validation-loss gaps to BF16; the shares are SNIP's share of the
oracle's gain over the recipe, (recipe - SNIP) / (recipe - oracle), differences paired by seed).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # quality_oracle, also where this file is loaded by path

HEURISTICS = ("first_last_k", "last_fraction", "layer_type", "min_rel_error", "random")
QUICK_HEURISTICS = ("first_last_k", "last_fraction", "min_rel_error")
SNIP_METHODS = ("snip_once", "snip_periodic")
FORMAT_FREE = ("bf16", "uniform_fp8")  # never touch the FP4 format: one run per seed serves every format
PINNED = ("single_fp4", "oracle")
"""Methods that train a pinned plan (bench/quality_oracle.py): one linear in FP4, or the oracle's set."""
# Defaults sized to about 2 hours on 2 CPU cores (quick: about 10 minutes): every method continues a
# 400-step BF16 prefix for 300 quantized steps (quick: 120), mid-way down the cosine schedule.
STEPS, QUICK_STEPS, PREFIX_STEPS = 700, 520, 400
METHODS = FORMAT_FREE + ("uniform_fp4",) + HEURISTICS + SNIP_METHODS + ("oracle",)


def at_root(path: str) -> Path:
    """`path`, relative ones taken from the repository root."""
    return Path(path) if Path(path).is_absolute() else ROOT / path


@dataclass(frozen=True)
class RunSpec:
    method: str
    budget: float | None
    seed: int
    fp4_recipe: str
    steps: int
    warmup: int
    model: dict
    data_cache: str
    max_bytes: int
    micro_batch_size: int
    run_dir: str
    prefix_steps: int = 0
    """Steps of a shared BF16 prefix: every method of a seed continues from its checkpoint (0: none)."""
    fp4_linears: tuple = ()
    """single_fp4 and oracle: the linears ("3.linear_fc1") their pinned plan holds in FP4, the others FP8."""
    moe: dict | None = None
    """The MoE layers' experts (models.gpt.MoEDims as a dict; --model's), None: a dense model."""

    @property
    def name(self) -> str:
        b = "" if self.budget is None else f"_{round(self.budget * 100)}"
        p = f"_from{self.prefix_steps}" if self.prefix_steps else ""
        if self.method == "single_fp4":  # one run per linear: the linear names it
            return f"{self.fp4_recipe}_single_{self.fp4_linears[0].replace('.', '_')}{p}_s{self.seed}"
        return f"{self.fp4_recipe}_{self.method}{b}{p}_s{self.seed}"

    @property
    def plan_path(self) -> Path:
        """Where a pinned method's plan is written (run_one) and read (its SnipConfig.plan)."""
        return at_root(self.run_dir) / self.name / "pinned_plan.json"

    @property
    def prefix_dir(self) -> Path:
        """The checkpoint folder of this seed's shared prefix, named by every setting it depends on."""
        import hashlib

        settings = [self.model, self.steps, self.micro_batch_size, self.max_bytes] + ([self.moe] if self.moe else [])
        settings = json.dumps(settings, sort_keys=True)
        tag = hashlib.sha1(settings.encode()).hexdigest()[:10]
        return at_root(self.run_dir) / f"prefix{self.prefix_steps}_{tag}_s{self.seed}"


def snip_config(spec: RunSpec):
    from snip_megatron.config import SnipConfig

    # After a shared BF16 prefix, the initial plan is the prefix's: BF16 until the warm-up measurement.
    initial = "bf16" if spec.prefix_steps else "fp8"
    common = dict(enabled=True, warmup=spec.warmup, lag=1, initial_precision=initial,
                  fp4_recipe=spec.fp4_recipe, seed=spec.seed, solver_time_limit_s=60, baseline_relax=True)
    budget = spec.budget if spec.budget is not None else 1.0
    if spec.method == "bf16":  # SNIP off, in the run's formats (the trainer runs them)
        return SnipConfig(enabled=False, fp4_recipe=spec.fp4_recipe)
    if spec.method in ("uniform_fp8", "uniform_fp4"):
        return SnipConfig(**common, baseline=spec.method, fp4_budget=budget, interval=spec.steps)
    if spec.method in HEURISTICS:
        return SnipConfig(**common, baseline=spec.method, fp4_budget=budget, interval=spec.steps)
    if spec.method == "snip_once":
        return SnipConfig(**common, fp4_budget=budget, interval=spec.steps)
    if spec.method == "snip_periodic":
        return SnipConfig(**common, fp4_budget=budget, interval=max(2, (spec.steps - spec.warmup) // 3))
    if spec.method in PINNED:  # the plan from the first quantized step on, never re-planned
        return SnipConfig(**common, fp4_budget=budget, interval=spec.steps, plan=str(spec.plan_path),
                          pin_plan=True)
    raise ValueError(f"unknown method {spec.method!r}")


def moe_of(spec: RunSpec):
    """The run's experts (models.gpt.MoEDims), None for a dense model."""
    from snip_megatron.models.gpt import MoEDims

    if not spec.moe:
        return None
    freq = spec.moe.get("layer_freq", 1)  # a per-layer list after the log's JSON: MoEDims keeps a tuple
    return MoEDims(**{**spec.moe, "layer_freq": freq if isinstance(freq, int) else tuple(freq)})


def train_config(spec: RunSpec, **overrides):
    """The TrainConfig of a run (and of its seed's prefix: the same schedule over the whole run)."""
    from snip_megatron.data.prepare import DataConfig
    from snip_megatron.shapes import ModelShape
    from snip_megatron.train.config import TrainConfig

    shape = ModelShape(**spec.model)
    branch = spec.steps - spec.prefix_steps
    settings = dict(model=shape, moe=moe_of(spec), steps=spec.steps, micro_batch_size=spec.micro_batch_size,
                    lr=3e-3, min_lr=3e-4, seed=spec.seed, eval_interval=max(1, branch // 4),
                    eval_batches=4, progress=False,
                    precision="bf16" if spec.method == "bf16" or spec.prefix_steps else "fp8",
                    formats=snip_config(spec).formats,  # the formats SNIP measures, one value
                    data=DataConfig(corpus="stdlib", vocab_size=shape.vocab_size,
                                    max_bytes=spec.max_bytes, cache_dir=str(at_root(spec.data_cache))))
    if spec.prefix_steps:
        settings.update(load_dir=str(spec.prefix_dir), load_step=spec.prefix_steps)
    settings.update(overrides)
    return TrainConfig(**settings)


def _worker_process() -> None:
    """Set up a fresh benchmark process: quiet, one thread (runs go in parallel processes)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)


def train_prefix(spec: RunSpec) -> dict:
    """Train this seed's shared prefix in BF16 (in this fresh process) and checkpoint it; a prefix
    already checkpointed is kept. Every method of the seed then continues from it, as every run
    would have trained these steps alike (the same initial plan, data and seed)."""
    _worker_process()
    from snip_megatron.train import checkpoint
    from snip_megatron.train.loop import Trainer

    start = time.perf_counter()
    try:
        checkpoint.verify(spec.prefix_dir, spec.prefix_steps)
        return {"prefix": str(spec.prefix_dir), "seconds": 0.0, "reused": True}
    except checkpoint.CheckpointError:
        pass  # none yet, or an unfinished one: train it
    trainer = Trainer(train_config(spec, load_dir=None, load_step=None, eval_interval=None))  # BF16
    while trainer.step < spec.prefix_steps:
        trainer.train_step()
    trainer.save(spec.prefix_dir)
    loss = trainer.evaluate()
    trainer.close()
    return {"prefix": str(spec.prefix_dir), "seconds": time.perf_counter() - start, "reused": False,
            "val_loss": loss}


def run_one(spec: RunSpec) -> dict:
    """One training run in this (fresh) process; returns its figures."""
    _worker_process()
    from snip_megatron.controller import SnipController
    from snip_megatron.formats.precision import Precision
    from snip_megatron.plan import Plan
    from snip_megatron.shapes import ModelShape
    from snip_megatron.train.loop import Trainer

    shape = ModelShape(**spec.model)
    run_dir = at_root(spec.run_dir) / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("*.jsonl"):
        stale.unlink()
    if spec.method in PINNED:
        from quality_oracle import pinned_plan

        pinned_plan(shape.num_layers, spec.fp4_linears).save(spec.plan_path)
    train = train_config(spec, metrics_path=str(run_dir / "metrics.jsonl"))
    ctrl = SnipController(snip_config(spec), shape, total_steps=spec.steps, run_dir=run_dir,
                          tokens_per_step=spec.micro_batch_size * shape.seq_length, log=lambda m: None,
                          inventory=train.inventory)
    start = time.perf_counter()
    trainer = Trainer(train, hooks=[ctrl])
    history = trainer.fit()
    trainer.config = _with_eval_batches(trainer.config, 32)  # the final evaluations: more batches
    final_plan = ctrl.plan
    val_plan = trainer.evaluate()
    trainer.set_plan(Plan.uniform(trainer.inventory, Precision.BF16))
    val_bf16 = trainer.evaluate()
    trainer.close()
    losses = [m["loss"] for m in history if m.get("loss") is not None]
    return {"spec": asdict(spec), "name": spec.name, "val_bf16": val_bf16, "val_plan": val_plan,
            "fp4_fraction": final_plan.fp4_fraction(ctrl.flops),
            "diverged": not all(math.isfinite(x) for x in losses) or not math.isfinite(val_bf16),
            "seconds": time.perf_counter() - start, "run_dir": str(Path(spec.run_dir) / spec.name)}


def read_log(path: Path) -> list[dict]:
    """The records of a results log (runs and invocation records), skipping a line cut off by an
    interrupted write; an absent log has none."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict):
            records.append(r)
    return records


def load_finished(path: Path, specs: list[RunSpec]) -> list[dict]:
    """The runs of `specs` already in the results log (a run counts only with identical settings)."""
    wanted = {s.name: json.loads(json.dumps(asdict(s))) for s in specs}  # as the log stores it
    finished = {}
    for r in read_log(path):
        if not isinstance(r.get("spec"), dict):
            continue  # an invocation record (load_invocations)
        r["spec"].setdefault("prefix_steps", 0)  # logs written before the shared prefix existed
        r["spec"].setdefault("fp4_linears", [])  # ... and before the oracle
        r["spec"].setdefault("moe", None)  # ... and before MoE models
        if wanted.get(r.get("name")) == r["spec"]:
            finished[r["name"]] = r
    return list(finished.values())


def load_invocations(path: Path) -> list[dict]:
    """The invocation records of a results log: one per invocation that ran something, with its
    arguments, wall time and prefix time (runs overlap in wall time, so it is not their sum)."""
    return [r["invocation"] for r in read_log(path) if isinstance(r.get("invocation"), dict)]


def _with_eval_batches(config, n):
    from dataclasses import replace

    return replace(config, eval_batches=n)


def budgets_of(args, fmt: str) -> list[float]:
    """FP4 budgets run for `fmt`: every budget for the main (first) format, fewer for the others."""
    return args.budgets if fmt == args.formats[0] else args.other_budgets


def warmup_of(args) -> int:
    """The warm-up measurement step: 20% into the run, or the first step after the shared prefix."""
    return args.prefix_steps + 1 if args.prefix_steps else max(1, round(0.2 * args.steps))


def heuristics_of(args) -> tuple[str, ...]:
    """The fixed rules this invocation runs (--quick: the best three; --methods: those named)."""
    rules = QUICK_HEURISTICS if args.quick else HEURISTICS
    return rules if args.methods is None else tuple(m for m in HEURISTICS if m in args.methods)


def wants_oracle(args) -> bool:
    """The oracle runs in the full benchmark, and with --quick or --methods only when named."""
    return "oracle" in args.methods if args.methods is not None else not args.quick


def budget_methods(args) -> tuple[str, ...]:
    """The methods run at each FP4 budget: the rules, then SNIP (--quick: periodic only)."""
    snip = ("snip_periodic",) if args.quick else SNIP_METHODS
    if args.methods is not None:
        snip = tuple(m for m in SNIP_METHODS if m in args.methods)
    return heuristics_of(args) + snip


def common_settings(args) -> dict:
    """The RunSpec fields every run of this invocation shares."""
    model = dict(name="quality", num_layers=args.layers, hidden_size=args.hidden,
                 ffn_hidden_size=args.ffn, num_attention_heads=args.heads, num_query_groups=args.groups,
                 vocab_size=args.vocab, seq_length=args.seq)
    return dict(steps=args.steps, warmup=warmup_of(args), model=model, data_cache=args.data_cache,
                max_bytes=args.max_bytes, micro_batch_size=args.micro_batch_size,
                run_dir=args.run_dir, prefix_steps=args.prefix_steps, moe=args.moe)


def build_specs(args) -> list[RunSpec]:
    """Every run that does not depend on another's result (the oracle's do: oracle_specs)."""
    from snip_megatron.plan import all_keys

    common = common_settings(args)
    methods = budget_methods(args)
    oracle = wants_oracle(args)
    main = args.formats[0]
    specs = []
    for fmt in args.formats:
        budgets = budgets_of(args, fmt)
        for seed in range(args.seeds):
            shared = FORMAT_FREE if fmt == main else ()  # filed under the main format
            for method in shared + ("uniform_fp4",):
                # the oracle's harms are taken to uniform FP8
                if method == "bf16" or args.methods is None or method in args.methods \
                        or (method == "uniform_fp8" and oracle):
                    specs.append(RunSpec(method=method, budget=None, seed=seed, fp4_recipe=fmt, **common))
            for budget in budgets:
                for method in methods:
                    specs.append(RunSpec(method=method, budget=budget, seed=seed, fp4_recipe=fmt, **common))
            if oracle and budgets:
                specs += [RunSpec(method="single_fp4", budget=None, seed=seed, fp4_recipe=fmt,
                                  fp4_linears=(str(key),), **common) for key in all_keys(args.layers)]
    return specs


_ORACLE_SETS: dict = {}


def oracle_specs(args, results: list[dict]) -> tuple[list[RunSpec], list[str]]:
    """The oracle's runs that the finished single-linear runs allow (per format, seed and budget: the
    knapsack over that seed's harms), and the names of those still waiting for their singles."""
    from quality_oracle import oracle_fp4_linears, single_harms

    from snip_megatron.plan import all_keys
    from snip_megatron.shapes import ModelShape

    if not wants_oracle(args):
        return [], []
    common = common_settings(args)
    shape = ModelShape(**common["model"])
    keys = [str(k) for k in all_keys(shape.num_layers)]
    fp8 = {r["spec"]["seed"]: r["val_bf16"] for r in results if r["spec"]["method"] == "uniform_fp8"}
    specs, waiting = [], []
    for fmt in args.formats:
        for seed in range(args.seeds):
            singles = {r["spec"]["fp4_linears"][0]: r["val_bf16"] for r in results
                       if r["spec"]["method"] == "single_fp4" and r["spec"]["fp4_recipe"] == fmt
                       and r["spec"]["seed"] == seed}
            for budget in budgets_of(args, fmt):
                spec = RunSpec(method="oracle", budget=budget, seed=seed, fp4_recipe=fmt, **common)
                if seed not in fp8 or set(singles) != set(keys):
                    waiting.append(spec.name)
                    continue
                harms = single_harms(singles, fp8[seed])
                key = (tuple(sorted(harms.items())), shape, budget)
                if key not in _ORACLE_SETS:  # asked after every finished run: solve each knapsack once
                    _ORACLE_SETS[key] = oracle_fp4_linears(harms, shape, budget,
                                                           tokens=args.micro_batch_size * args.seq)
                fp4 = _ORACLE_SETS[key]
                specs.append(RunSpec(**{**asdict(spec), "fp4_linears": fp4}))
    return specs, waiting


# -- aggregation ---------------------------------------------------------------------------------

RECIPES = ("last_fraction", "min_rel_error")
"""The recipes a user would reach for first: NVIDIA's NVFP4 recipe (the last layers high), and FP4 for
the linears it quantizes best."""


def summarize(results: list[dict], fmt: str, budgets, heuristics) -> dict:
    mine = [r for r in results if r["spec"]["fp4_recipe"] == fmt or r["spec"]["method"] in FORMAT_FREE]
    by = {(r["spec"]["method"], r["spec"]["budget"], r["spec"]["seed"]): r
          for r in mine if r["spec"]["method"] != "single_fp4"}
    seeds = sorted({s for (_, _, s) in by})
    bf16 = {s: by[("bf16", None, s)]["val_bf16"] for s in seeds if ("bf16", None, s) in by}

    def gaps(method, budget, key="val_bf16"):
        out = {}
        for s in seeds:
            r = by.get((method, budget, s))
            if r is not None and s in bf16:
                out[s] = (r[key] - bf16[s]) / bf16[s]
        return out

    rows, all_gaps = [], {}
    snip_main = "snip_periodic"
    cells = [("uniform_fp8", None), ("uniform_fp4", None)] + [
        (m, b) for b in budgets for m in heuristics + SNIP_METHODS + ("oracle",)]
    for method, budget in cells:
        g = gaps(method, budget)
        if not g:
            continue
        all_gaps[(method, budget)] = g
        g_plan = gaps(method, budget, "val_plan")
        snip = gaps(snip_main, budget) if budget is not None else {}
        paired = [g[s] - snip[s] for s in g if s in snip]
        runs = [by[(method, budget, s)] for s in g]
        rows.append({
            "method": method, "budget": budget,
            "gap_mean": statistics.fmean(g.values()),
            "gap_spread": statistics.pstdev(g.values()) if len(g) > 1 else 0.0,
            "gap_abs_mean": statistics.fmean(by[(method, budget, s)]["val_bf16"] - bf16[s] for s in g),
            "gap_plan_mean": statistics.fmean(g_plan.values()),
            "vs_snip_mean": statistics.fmean(paired) if paired else math.nan,
            "vs_snip_spread": statistics.pstdev(paired) if len(paired) > 1 else 0.0,
            "fp4": statistics.fmean(r["fp4_fraction"] for r in runs),
            "diverged": sum(r["diverged"] for r in runs),
            "seeds": len(g),
        })
    fp8 = gaps("uniform_fp8", None)
    harms = {}  # linear -> seed -> its single-FP4 gap minus uniform FP8's (relative to BF16)
    for r in mine:
        s = r["spec"]
        if s["method"] == "single_fp4" and s["seed"] in fp8:
            harms.setdefault(s["fp4_linears"][0], {})[s["seed"]] = \
                (r["val_bf16"] - bf16[s["seed"]]) / bf16[s["seed"]] - fp8[s["seed"]]
    bf = list(bf16.values())
    return {"rows": rows, "bf16": bf16, "gaps": all_gaps, "harms": harms,
            "noise": statistics.pstdev(bf) / statistics.fmean(bf) if len(bf) > 1 else math.nan}


def recipe_of(summary: dict, budget: float) -> str | None:
    """The recipe with the smaller mean gap at `budget` (None when neither ran)."""
    ran = [(statistics.fmean(summary["gaps"][(m, budget)].values()), m) for m in RECIPES
           if (m, budget) in summary["gaps"]]
    return min(ran)[1] if ran else None


def oracle_share_at(summary: dict, budget: float) -> float:
    """SNIP's (periodic) share of the oracle's gain over the recipe at `budget`, paired by seed."""
    from quality_oracle import oracle_share

    recipe, g = recipe_of(summary, budget), summary["gaps"]
    if recipe is None or ("snip_periodic", budget) not in g or ("oracle", budget) not in g:
        return math.nan
    return oracle_share(g[(recipe, budget)], g[("snip_periodic", budget)], g[("oracle", budget)])


def result_line(summary: dict, heuristics) -> str:
    rows = {(r["method"], r["budget"]): r for r in summary["rows"]}

    def gap(m, b):
        r = rows.get((m, b))
        return r["gap_mean"] if r else math.nan

    parts = []
    for b in (0.75, 0.8):
        tag = round(b * 100)
        best = min((gap(h, b) for h in heuristics if (h, b) in rows), default=math.nan)
        recipe = recipe_of(summary, b)
        parts += [f"snip_gap_{tag}={gap('snip_periodic', b):.5f}", f"best_baseline_gap_{tag}={best:.5f}",
                  f"recipe_gap_{tag}={gap(recipe, b):.5f}"]
    parts += [f"uniform_fp4_gap={gap('uniform_fp4', None):.5f}", f"noise={summary['noise']:.5f}",
              f"oracle_gap_75={gap('oracle', 0.75):.5f}", f"oracle_share_75={oracle_share_at(summary, 0.75):.3f}",
              f"oracle_share_80={oracle_share_at(summary, 0.8):.3f}"]
    return "RESULT " + " ".join(parts)


def format_table(summary: dict) -> str:
    lines = ["| method | FP4 budget | achieved FP4 | rel. gap to BF16 (mean ± spread) | abs. gap (nats) | "
             "rel. gap, final plan applied | rel. gap minus SNIP periodic's, same seed (mean ± spread) | diverged |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        b = "-" if r["budget"] is None else f"{r['budget']:.0%}"
        vs = "-" if math.isnan(r["vs_snip_mean"]) else f"{r['vs_snip_mean']:+.3%} ± {r['vs_snip_spread']:.3%}"
        lines.append(f"| {r['method']} | {b} | {r['fp4']:.1%} | {r['gap_mean']:+.3%} ± {r['gap_spread']:.3%} | "
                     f"{r['gap_abs_mean']:+.5f} | {r['gap_plan_mean']:+.3%} | {vs} | {r['diverged']}/{r['seeds']} |")
    return "\n".join(lines)


def format_oracle(summary: dict, budgets) -> str:
    """The oracle against the recipe and SNIP per budget, then each linear's single-FP4 harm."""
    g = summary["gaps"]
    if not summary["harms"]:
        return ""
    lines = ["| FP4 budget | recipe | recipe gap | SNIP periodic gap | oracle gap | oracle seeds | "
             "SNIP's share of the oracle's gain (the oracle's seeds) |",
             "|---|---|---|---|---|---|---|"]

    def mean(cell):
        return f"{statistics.fmean(g[cell].values()):+.3%}" if cell in g else "-"

    for b in budgets:
        recipe = recipe_of(summary, b)
        share = oracle_share_at(summary, b)
        lines.append(f"| {b:.0%} | {recipe or '-'} | {mean((recipe, b))} | {mean(('snip_periodic', b))} | "
                     f"{mean(('oracle', b))} | {len(g.get(('oracle', b), {}))} | "
                     f"{'-' if math.isnan(share) else f'{share:.2f}'} |")
    from snip_megatron.plan import forward_order, parse_key

    lines += ["", "| linear | FP4 harm alone (rel. gap minus uniform FP8's; mean ± spread) | seeds |", "|---|---|---|"]
    for key in sorted(summary["harms"], key=lambda k: forward_order(parse_key(k))):
        h = list(summary["harms"][key].values())
        spread = statistics.pstdev(h) if len(h) > 1 else 0.0
        lines.append(f"| {key} | {statistics.fmean(h):+.3%} ± {spread:.3%} | {len(h)} |")
    return "\n".join(lines)


def draw_curves(results: list[dict], fmt: str, budget: float, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from snip_megatron.report import read_jsonl

    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = 0
    for r in results:
        s = r["spec"]
        if (s["fp4_recipe"] != fmt and s["method"] not in FORMAT_FREE) or s["seed"] != 0 \
                or s["budget"] not in (None, budget):
            continue
        path = at_root(r["run_dir"]) / "metrics.jsonl"
        if not path.exists():  # a run whose folder is gone: its figures stay in the table
            continue
        metrics = read_jsonl(path)
        val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), marker="o", ms=3, label=s["method"])
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{fmt}, FP4 budget {budget:.0%}, seed 0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def timing_text(args, results: list[dict]) -> str:
    """Wall time from the log's invocation records (summed when the benchmark was resumed)."""
    invocations = args.invocations
    process = f"{process_minutes(results):.0f} process-minutes in {len(results)} runs"
    if not invocations:
        return f"{process}, {args.jobs} at a time (no wall time is recorded in the results log)."
    wall = sum(i["wall_s"] for i in invocations) / 60
    prefix = sum(i.get("prefix_s", 0.0) for i in invocations) / 60
    unrecorded = len(results) - sum(i["runs"] for i in invocations)
    return (f"wall time {wall:.1f} min" + (f" over {len(invocations)} invocations" if len(invocations) > 1 else "")
            + f", {process}" + (f" and {prefix:.0f} training the shared prefixes" if prefix else "")
            + (f" ({unrecorded} of the runs from an earlier invocation that recorded no wall time)"
               if unrecorded > 0 else "")
            + (". This report was made from the results log." if args.report_only else "."))


ANSWERS = ("Answers: how SNIP's per-layer plans compare at equal FP4 budgets with uniform precision, the fixed "
           "rules, the recipe and an oracle, in final validation loss, on CPU (the summary and the other figures: "
           "[status.md](status.md)).")
"""The main report's first line (docs/ pages each open with what they answer)."""


def write_results(path: Path, args, results, summaries, lines) -> None:
    from snip_megatron.report import PLANS_FILE, draw_heatmap, load_plan_history

    docs = path.parent
    docs.mkdir(parents=True, exist_ok=True)
    main_fmt = args.formats[0]
    # the main report's figures keep their names; a companion report's are named after it
    figures = "quality" if path.name == "results.md" else path.stem
    curves = draw_curves(results, main_fmt, 0.75, docs / f"{figures}_curves.png")
    heat = None
    snip_runs = [r for r in results if r["spec"]["method"] == "snip_periodic" and r["spec"]["fp4_recipe"] == main_fmt
                 and r["spec"]["seed"] == 0 and r["spec"]["budget"] == 0.75]
    if snip_runs and (at_root(snip_runs[0]["run_dir"]) / PLANS_FILE).exists():  # a report from the log alone: none
        heat = draw_heatmap(load_plan_history(at_root(snip_runs[0]["run_dir"])), docs / f"{figures}_snip_heatmap.png",
                            args.steps)
    cpu = _cpu_name()
    # a companion report (--model) is a section of docs/results.md (write_results appends it there)
    h = "#" if args.model is None else "##"
    title = "Quality at equal FP4 budgets" + (f", {args.model}" if args.model else "")
    text = [
        f"{h} {title} (written by `bench/quality.py`)",
        "",
        *([ANSWERS, ""] if args.model is None and docs.name == "docs" else []),
        f"Command: `{' '.join(['python bench/quality.py'] + [a for a in args.argv if a not in ('--report-only', '--resume')])}`  ",
        f"Machine: {_device_name()}, {os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}; "
        + timing_text(args, results),
        f"Model: {args.layers} layers, hidden {args.hidden}, FFN {args.ffn}, {args.heads} heads "
        f"({args.groups} query groups), seq {args.seq}, vocab {args.vocab}; " + experts_text(args.moe)
        + f"{args.steps} steps, micro-batch {args.micro_batch_size}; {args.seeds} seeds; "
        + (f"a shared BF16 prefix of {args.prefix_steps} steps per seed (checkpointed once; every method "
           f"continues from it, SNIP measures at step {warmup_of(args)}). " if args.prefix_steps else
           f"warm-up (all FP8) {warmup_of(args)} steps. ")
        + "Gaps: final validation loss (32 held-out batches) of the "
        "final weights evaluated in BF16, relative to the BF16 run of the same seed. \"BF16\" is the "
        "unquantized model: FP32 parameters, every planned linear unquantized. Heuristics whose kept "
        "linears leave less than the budget are relaxed (the kept linears get FP4 last).",
        "",
    ]
    relabelled = [r for r in results if r.get("relabelled")]
    if relabelled:
        notes = sorted({r["relabelled"] for r in relabelled})
        text += [f"{len(relabelled)} runs carry a `relabelled` note in the results log: " + " / ".join(notes), ""]
    if getattr(args, "missing", None):
        text += [f"**Unfinished: {len(args.missing)} of the benchmark's runs have not run yet** "
                 f"(`{' '.join(['python bench/quality.py'] + [a for a in args.argv if a != '--report-only'] + ['--resume'])}` "
                 "runs them); the tables below hold the runs that have.", ""]
    for fmt, summary in summaries.items():
        oracle = format_oracle(summary, budgets_of(args, fmt))
        text += [f"{h}# {fmt}", "", format_table(summary), ""]
        if oracle:
            text += ["The oracle: each linear alone in FP4 from the prefix checkpoint over the quantized "
                     "phase (the others FP8), then the knapsack over those harms at each budget, trained "
                     "pinned. SNIP's share is (recipe - SNIP) / (recipe - oracle), differences paired by "
                     "seed.", "", oracle, ""]
        text += [
                 f"BF16 validation loss per seed: {', '.join(f'{v:.4f}' for v in summary['bf16'].values())} "
                 f"(relative spread {summary['noise']:.4f}).", "", "```", lines[fmt], "```", ""]
    if curves:
        text += [f"![validation loss]({curves.name})", ""]
    if heat:
        text += [f"![SNIP plan over training]({heat.name})", ""]
    if args.model is None:
        for part in companions(docs, path):
            text += [part.read_text()]
    path.write_text("\n".join(text))


def companions(docs: Path, path: Path) -> list[Path]:
    """The reports the main one ends with: bench/quality_regimes.py's map of where FP4 hurts, then
    every docs/results_*.md (this benchmark's --model runs, and the MoE evidence of the other
    benchmarks), each kept where it is and appended whole."""
    parts = [docs / "quality_regimes.md"] + sorted(docs.glob("results_*.md"))
    return [q for q in parts if q.exists() and q.resolve() != path.resolve()]


def experts_text(moe: "dict | None") -> str:
    """The experts of an MoE model, for the report's model line ("" for a dense model)."""
    if not moe:
        return ""
    freq = moe["layer_freq"]
    where = "every layer" if freq == 1 else (f"every {freq}th layer" if isinstance(freq, int) else f"layers {freq}")
    return (f"MoE ({where}): {moe['num_experts']} experts of FFN {moe['ffn_hidden_size']}, top-{moe['topk']}"
            + (f", shared experts of FFN {moe['shared_ffn_hidden_size']}" if moe.get("shared_ffn_hidden_size") else "")
            + "; ")


def process_minutes(results: list[dict]) -> float:
    """Minutes the runs took, summed over runs (parallel runs overlap in wall time)."""
    return sum(r["seconds"] for r in results) / 60


def _device_name() -> str:
    import torch

    return f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


DIMS = (("--layers", 6, "transformer layers"), ("--hidden", 128, "hidden size"), ("--ffn", 352, "FFN hidden size"),
        ("--heads", 4, "attention heads"), ("--groups", 2, "query groups (GQA)"), ("--seq", 128, "sequence length"))
"""The model dimension flags and the dense model's defaults."""
_SHAPE_FIELD = {"--layers": "num_layers", "--hidden": "hidden_size", "--ffn": "ffn_hidden_size",
                "--heads": "num_attention_heads", "--groups": "num_query_groups", "--seq": "seq_length"}


def model_defaults(p: argparse.ArgumentParser, args) -> None:
    """Fill the dimensions not given from --model's preset (or the dense defaults), its experts into
    args.moe, and the run folder and report named after it."""
    from dataclasses import asdict as fields_of

    from snip_megatron.models.gpt import PRESET_MOE
    from snip_megatron.shapes import PRESETS

    shape = None
    if args.model is not None:
        if args.model not in PRESETS:
            p.error(f"--model {args.model}: unknown; presets: {', '.join(PRESETS)}")
        shape = PRESETS[args.model]
    for flag, dense, _ in DIMS:
        dest = flag[2:]
        if getattr(args, dest) is None:
            setattr(args, dest, dense if shape is None else getattr(shape, _SHAPE_FIELD[flag]))
    moe = PRESET_MOE.get(args.model) if args.model else None
    args.moe = fields_of(moe) if moe is not None else None
    args.run_dir = args.run_dir or ("runs/quality" if args.model is None else f"runs/quality_{args.model}")
    args.out = args.out or ("docs/results.md" if args.model is None else f"docs/results_{args.model}.md")


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's settings, with the full run's (or --quick's) defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--formats", default=None,
                   help="comma list, main format first (default nvfp4,mxfp4; quick: nvfp4)")
    p.add_argument("--budgets", default=None, help="FP4 fractions for the main format (default 0.5,0.75,0.8,0.9)")
    p.add_argument("--other-budgets", default="0.75,0.8,0.9", help="FP4 fractions for the other formats")
    p.add_argument("--methods", default=None,
                   help="comma list: run only these methods (BF16 always runs: every gap is taken to it); "
                        f"any of {', '.join(METHODS)}")
    p.add_argument("--resume", action="store_true", help="skip runs already in the results log")
    p.add_argument("--fresh", action="store_true",
                   help="start over: delete the results log first (a log with finished runs is never replaced without it)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: report the runs in the results log (an unfinished benchmark says so)")
    p.add_argument("--log", default=None, help="results log (JSONL; default <run-dir>/results.jsonl)")
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps of every run, the prefix included (default 700; quick: 520)")
    p.add_argument("--prefix-steps", type=int, default=None,
                   help="train the first N steps once per seed in BF16 and continue every method from that "
                        "checkpoint (the paper's setting: SNIP applied to a pretrained checkpoint; default 400); "
                        "0: none, every method trains from step 0")
    p.add_argument("--model", default=None,
                   help="a compact-loop preset (snip_megatron.shapes.PRESETS) whose dimensions are the defaults "
                        "of --layers ... --seq and whose experts (models.gpt.PRESET_MOE), if any, every run has: "
                        "e.g. llama_tiny_moe8 (8 experts, top-2, every layer MoE); default: the dense model below")
    for flag, dense, what in DIMS:
        p.add_argument(flag, type=int, default=None, help=f"{what} (default {dense}, or --model's)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=6_000_000)
    p.add_argument("--jobs", type=int, default=2)
    # Relative paths are taken from the repository root (and stored so in the results log).
    p.add_argument("--data-cache", default=".cache/snip-data")
    p.add_argument("--run-dir", default=None, help="default runs/quality (with --model: runs/quality_<model>)")
    p.add_argument("--out", default=None, help="the report (relative paths from the repository root; default "
                   "docs/results.md, with --model docs/results_<model>.md, which docs/results.md includes)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    model_defaults(p, args)
    args.formats = (args.formats or ("nvfp4" if args.quick else "nvfp4,mxfp4")).split(",")
    args.budgets = [float(b) for b in (args.budgets or ("0.75,0.8" if args.quick else "0.5,0.75,0.8,0.9")).split(",")]
    args.other_budgets = [float(b) for b in args.other_budgets.split(",")]
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    args.prefix_steps = PREFIX_STEPS if args.prefix_steps is None else args.prefix_steps
    if args.methods is not None:
        args.methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        unknown = [m for m in args.methods if m not in METHODS]
        if unknown or not args.methods:
            p.error(f"--methods: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(METHODS)}")
    if args.moe is not None and wants_oracle(args):
        p.error(f"the oracle (--methods ...,oracle, or the full benchmark) lists a dense model's linears; with "
                f"the MoE --model {args.model} pass --quick or --methods without oracle")
    args.log_path = at_root(args.log) if args.log else at_root(args.run_dir) / "results.jsonl"
    if args.fresh and (args.resume or args.report_only):
        p.error("--fresh deletes the results log; it cannot go with --resume or --report-only")
    if not 0 <= args.prefix_steps < args.steps - 1:
        p.error(f"--prefix-steps {args.prefix_steps} must leave at least 2 of the {args.steps} steps "
                f"(pass a smaller --prefix-steps, or 0 for none)")
    return args


def train_runs(args, todo: list[RunSpec], results: list[dict], log_path: Path, total: int,
               follow_up=None) -> int:
    """Train `todo` (their seeds' prefixes first), appending each finished run to `results` and the log.
    `follow_up(results)` names the runs a finished one made possible (the oracle's, once a seed's
    singles are in): they go first, so an interrupted benchmark leaves whole comparisons behind.
    Returns the number of runs trained."""
    if not todo:
        return 0
    if args.prefix_steps:
        prefixes = list({s.seed: s for s in todo}.values())  # one per seed that still has runs
        # Not a Pool: its workers are daemonic, and Megatron's checkpoint save starts a process.
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            for r in pool.map(train_prefix, prefixes):
                args.prefix_seconds += r["seconds"]
                print(f"prefix {r['prefix']}: " + ("reused" if r["reused"] else
                      f"val {r['val_loss']:.4f}, {r['seconds']:.0f} s"), flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready, seen, trained = list(todo), {s.name for s in todo} | {r["name"] for r in results}, 0
    finished = queue.SimpleQueue()
    with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool, log_path.open("a") as log:
        running = 0
        while ready or running:
            while ready and running < args.jobs:  # at most `jobs` queued: follow-ups can go first
                pool.apply_async(run_one, (ready.pop(0),), callback=finished.put, error_callback=finished.put)
                running += 1
            r = finished.get()
            running -= 1
            if isinstance(r, BaseException):
                raise r
            results.append(r)
            trained += 1
            log.write(json.dumps(r) + "\n")
            log.flush()
            print(f"[{len(results)}/{total}] {r['name']}: val(bf16) {r['val_bf16']:.4f} "
                  f"val(plan) {r['val_plan']:.4f} fp4 {r['fp4_fraction']:.1%} {r['seconds']:.0f} s", flush=True)
            new = [s for s in (follow_up(results) if follow_up else []) if s.name not in seen]
            seen |= {s.name for s in new}
            ready[:0] = new
    return trained


def refuse_to_replace(args) -> None:
    """A results log with finished runs (hours of them) is only deleted when --fresh says so."""
    if not (args.fresh or args.resume or args.report_only) and any("spec" in r for r in read_log(args.log_path)):
        raise SystemExit(f"bench/quality.py: error: {args.log_path} already holds finished runs: pass --resume "
                         f"to continue it, --report-only to report it, --fresh to delete it and start over, "
                         f"or --log for another log")


def main(argv=None) -> None:
    args = parse_args(argv)
    refuse_to_replace(args)
    heuristics = heuristics_of(args)

    # Tokenize once, before the workers start (they would race on the cache otherwise).
    from snip_megatron.data.prepare import DataConfig, prepare
    prepare(DataConfig(corpus="stdlib", vocab_size=args.vocab, max_bytes=args.max_bytes, cache_dir=str(at_root(args.data_cache))))

    specs = build_specs(args)
    log_path = args.log_path
    keep = args.resume or args.report_only
    results = load_finished(log_path, specs) if keep else []
    if not keep and log_path.exists():
        log_path.unlink()
    done = {r["name"] for r in results}
    todo = [] if args.report_only else [s for s in specs if s.name not in done]
    oracle_runs = args.seeds * sum(len(budgets_of(args, f)) for f in args.formats) if wants_oracle(args) else 0
    total = len(specs) + oracle_runs
    print(f"{len(specs)} runs ({len(results)} already done)"
          + (f", then up to {oracle_runs} oracle runs" if oracle_runs else "") + f", {args.jobs} at a time", flush=True)
    start = time.perf_counter()
    args.prefix_seconds = 0.0
    # The oracle's plans are the knapsack over a seed's single-linear runs: those already logged are
    # read (each looked up in the log once: its seed's singles, and so its plan, are final), the rest
    # run as soon as their seed's singles are in.
    looked_up = set()

    def oracle_runs_ready(results):
        oracle, _ = oracle_specs(args, results)
        fresh = [s for s in oracle if s.name not in looked_up]
        looked_up.update(s.name for s in fresh)
        results += load_finished(log_path, fresh) if fresh and log_path.exists() else []
        done = {r["name"] for r in results}
        return [s for s in oracle if s.name not in done]

    oracle_todo = oracle_runs_ready(results)
    trained = 0 if args.report_only else train_runs(args, oracle_todo + todo, results, log_path, total,
                                                    follow_up=oracle_runs_ready)
    oracle, waiting = oracle_specs(args, results)
    done = {r["name"] for r in results}
    args.missing = ([s.name for s in specs if s.name not in done] + waiting
                    + [s.name for s in oracle if s.name not in done]) if args.report_only else []
    wall = time.perf_counter() - start
    if trained:
        with log_path.open("a") as log:
            log.write(json.dumps({"invocation": {"argv": args.argv, "wall_s": wall, "prefix_s": args.prefix_seconds,
                                                 "runs": trained}}) + "\n")
    args.invocations = load_invocations(log_path)
    summaries, lines = {}, {}
    for fmt in args.formats:
        summaries[fmt] = summarize(results, fmt, budgets_of(args, fmt), heuristics)
        lines[fmt] = result_line(summaries[fmt], heuristics)
        print(f"\n## {fmt}\n{format_table(summaries[fmt])}\n{lines[fmt]}")
    write_results(at_root(args.out), args, results, summaries, lines)
    print(f"wrote {args.out}; {timing_text(args, results)}")
    print(lines[args.formats[0]])


if __name__ == "__main__":
    main()
