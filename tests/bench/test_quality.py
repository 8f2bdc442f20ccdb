"""bench/quality.py bookkeeping: which runs exist, resuming, and the paired gap arithmetic."""

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_full_run_shares_format_free_runs_and_gives_every_method_each_budget(quality):
    args = quality.parse_args([])
    specs = quality.build_specs(args)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    main, other = args.formats
    assert (main, other) == ("nvfp4", "mxfp4") and (args.steps, args.prefix_steps) == (700, 400)
    for seed in range(3):
        p = f"_from400_s{seed}"
        # BF16 and uniform FP8 once per seed (filed under the main format), uniform FP4 per format.
        assert f"{main}_bf16{p}" in names and f"{other}_bf16{p}" not in names
        assert f"{main}_uniform_fp8{p}" in names and f"{other}_uniform_fp8{p}" not in names
        assert f"{main}_uniform_fp4{p}" in names and f"{other}_uniform_fp4{p}" in names
        for method in quality.HEURISTICS + quality.SNIP_METHODS:
            assert all(f"{main}_{method}_{b}{p}" in names for b in (50, 75, 80, 90))
            assert all(f"{other}_{method}_{b}{p}" in names for b in (75, 80, 90))
            assert f"{other}_{method}_50{p}" not in names
    # ... and the oracle's 24 single-linear runs per seed and format (its own runs follow them)
    assert len(specs) == 3 * (3 + 4 * 7) + 3 * (1 + 3 * 7) + 2 * 3 * 24


def test_heuristics_run_relaxed_at_the_same_budget(quality):
    spec = quality.RunSpec(method="first_last_k", budget=0.9, seed=0, fp4_recipe="mxfp4", steps=10, warmup=2,
                           model={}, data_cache="", max_bytes=1, micro_batch_size=1, run_dir="")
    cfg = quality.snip_config(spec)
    assert cfg.baseline == "first_last_k" and cfg.baseline_relax and cfg.fp4_budget == 0.9
    assert not quality.snip_config(quality.RunSpec(**{**asdict(spec), "method": "bf16", "budget": None})).enabled
    with pytest.raises(ValueError, match="unknown method"):
        quality.snip_config(quality.RunSpec(**{**asdict(spec), "method": "snip_twice"}))


def test_resume_keeps_only_runs_with_identical_settings(quality, tmp_path):
    base = dict(seed=0, fp4_recipe="mxfp4", steps=10, warmup=2, model={"num_layers": 2}, data_cache="",
                max_bytes=1, micro_batch_size=1, run_dir="")
    a = quality.RunSpec(method="bf16", budget=None, **base)
    b = quality.RunSpec(method="snip_once", budget=0.75, **base)
    log = tmp_path / "results.jsonl"
    changed = {**asdict(b), "steps": 20}  # same name, other settings: must run again
    log.write_text("\n".join([json.dumps({"name": a.name, "spec": asdict(a), "val_bf16": 1.0}),
                              json.dumps({"name": b.name, "spec": changed, "val_bf16": 2.0}),
                              '{"name": "cut off']) + "\n")
    done = quality.load_finished(log, [a, b])
    assert [r["name"] for r in done] == [a.name]
    assert quality.load_finished(tmp_path / "missing.jsonl", [a]) == []


def _result(method, budget, seed, val, fmt="mxfp4", fp4=0.0):
    return {"spec": {"method": method, "budget": budget, "seed": seed, "fp4_recipe": fmt},
            "val_bf16": val, "val_plan": val, "fp4_fraction": fp4, "diverged": False}


def test_summary_gaps_are_paired_by_seed_and_shared_runs_serve_every_format(quality):
    results = []
    for seed, base in ((0, 4.0), (1, 5.0)):
        results += [_result("bf16", None, seed, base), _result("uniform_fp8", None, seed, base * 1.01),
                    _result("uniform_fp4", None, seed, base * 1.04, fmt="nvfp4", fp4=1.0),
                    _result("snip_periodic", 0.75, seed, base * 1.02, fmt="nvfp4", fp4=0.75),
                    _result("last_fraction", 0.75, seed, base * (1.03 + 0.01 * seed), fmt="nvfp4", fp4=0.75)]
    summary = quality.summarize(results, "nvfp4", [0.75], ("last_fraction",))
    rows = {(r["method"], r["budget"]): r for r in summary["rows"]}
    assert rows[("uniform_fp8", None)]["gap_mean"] == pytest.approx(0.01)  # from the main format's runs
    assert rows[("snip_periodic", 0.75)]["gap_mean"] == pytest.approx(0.02)
    lf = rows[("last_fraction", 0.75)]
    assert lf["gap_mean"] == pytest.approx(0.035) and lf["gap_spread"] == pytest.approx(0.005)
    assert lf["vs_snip_mean"] == pytest.approx(0.015) and lf["vs_snip_spread"] == pytest.approx(0.005)
    assert summary["noise"] == pytest.approx(0.5 / 4.5)
    line = quality.result_line(summary, ("last_fraction",))
    assert "snip_gap_75=0.02000" in line and "best_baseline_gap_75=0.03500" in line
    assert "uniform_fp4_gap=0.04000" in line and "snip_gap_80=nan" in line
    assert not math.isnan(summary["noise"])
    row = next(r for r in quality.format_table(summary).splitlines() if r.startswith("| last_fraction |"))
    # every relative figure in percent, the paired difference included (not a bare fraction)
    assert "| +3.500% ± 0.500% | +0.16000 | +3.500% | +1.500% ± 0.500% | 0/2 |" in row


def test_methods_selects_a_subset_and_bf16_always_runs(quality):
    args = quality.parse_args(["--methods", "snip_once,snip_periodic", "--seeds", "5", "--budgets", "0.8",
                               "--formats", "nvfp4"])
    specs = quality.build_specs(args)
    assert {(s.method, s.budget) for s in specs} == {("bf16", None), ("snip_once", 0.8), ("snip_periodic", 0.8)}
    assert sorted({s.seed for s in specs}) == list(range(5)) and len(specs) == 15
    assert quality.heuristics_of(args) == ()
    rules = quality.parse_args(["--quick", "--methods", "random,uniform_fp4"])
    assert quality.budget_methods(rules) == ("random",)
    assert {s.method for s in quality.build_specs(rules)} == {"bf16", "uniform_fp4", "random"}
    for bad in ("snip_twice", ",", "bf16,fp3"):
        with pytest.raises(SystemExit):
            quality.parse_args(["--methods", bad])


def test_the_log_records_each_invocations_wall_time_and_the_report_sums_them(quality, tmp_path):
    a = quality.RunSpec(method="bf16", budget=None, seed=0, fp4_recipe="nvfp4", steps=10, warmup=2, model={},
                        data_cache="", max_bytes=1, micro_batch_size=1, run_dir="")
    log = tmp_path / "results.jsonl"
    run = {"name": a.name, "spec": asdict(a), "val_bf16": 1.0, "seconds": 120.0}
    log.write_text("\n".join(json.dumps(x) for x in [
        run, {"invocation": {"argv": [], "wall_s": 600.0, "prefix_s": 60.0, "runs": 1}},
        {"invocation": {"argv": ["--resume"], "wall_s": 300.0, "prefix_s": 0.0, "runs": 0}}]) + "\n")
    assert [r["name"] for r in quality.load_finished(log, [a])] == [a.name]  # records are not runs
    invocations = quality.load_invocations(log)
    assert [i["wall_s"] for i in invocations] == [600.0, 300.0]
    args = quality.parse_args(["--report-only"])
    args.invocations = invocations
    text = quality.timing_text(args, [run])
    assert text.startswith("wall time 15.0 min over 2 invocations, 2 process-minutes in 1 runs and 1 training")
    assert "from the results log" in text
    args.invocations = invocations[:1] + [{"wall_s": 60.0, "runs": 0}]
    assert "earlier invocation" not in quality.timing_text(args, [run])
    args.invocations = []
    assert "no wall time" in quality.timing_text(args, [run])
    args.invocations = [{"wall_s": 60.0, "runs": 0}]
    assert "1 of the runs from an earlier invocation that recorded no wall time" in quality.timing_text(args, [run])


def test_shared_prefix_runs_continue_from_one_checkpoint_per_seed(quality):
    args = quality.parse_args(["--quick", "--steps", "160", "--prefix-steps", "100"])
    specs = quality.build_specs(args)
    assert {s.prefix_steps for s in specs} == {100} and {s.warmup for s in specs} == {101}
    assert all(s.name.endswith(f"_from100_s{s.seed}") for s in specs)
    by_seed = {}
    for s in specs:  # one prefix per seed, whatever the method, budget or format
        by_seed.setdefault(s.seed, set()).add(s.prefix_dir)
    assert all(len(d) == 1 for d in by_seed.values()) and len({*by_seed[0], *by_seed[1]}) == 2
    snip = next(s for s in specs if s.method == "snip_periodic")
    assert quality.snip_config(snip).initial_precision == "bf16"  # the prefix's plan until the warm-up
    assert quality.snip_config(snip).warmup_steps(160) == 101
    other = quality.RunSpec(**{**asdict(snip), "micro_batch_size": 8})
    assert other.prefix_dir != snip.prefix_dir  # another prefix for other training settings
    plain = quality.build_specs(quality.parse_args(["--quick", "--steps", "120", "--prefix-steps", "0"]))
    assert {s.prefix_steps for s in plain} == {0} and "_from" not in plain[0].name
    assert {s.warmup for s in plain} == {24}  # without a prefix: all FP8 until 20% of the run
    quick = quality.parse_args(["--quick"])
    assert (quick.steps, quick.prefix_steps) == (520, 400)  # the quick default shares a prefix too
    with pytest.raises(SystemExit):
        quality.parse_args(["--steps", "100", "--prefix-steps", "99"])
    with pytest.raises(SystemExit):  # the default prefix does not fit in 300 steps: said, not shrunk
        quality.parse_args(["--steps", "300"])


def test_a_run_from_the_shared_prefix_equals_the_uninterrupted_run(quality, tmp_path):
    """The prefix is an optimisation only: BF16 continued from its checkpoint ends bit for bit where
    one BF16 run over all the steps does, and a quantized method continues from the same weights."""
    import torch

    from snip_megatron.formats.precision import Precision
    from snip_megatron.plan import LayerKey, Plan
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.report import load_plan_history
    from snip_megatron.shapes import ModelShape

    threads = torch.get_num_threads()
    model = dict(name="quality_test", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=512, seq_length=32)
    base = dict(seed=0, fp4_recipe="nvfp4", steps=6, model=model, data_cache=str(tmp_path / "data"),
                max_bytes=300_000, micro_batch_size=2, run_dir=str(tmp_path / "runs"))
    from snip_megatron.data.prepare import DataConfig, prepare

    prepare(DataConfig(corpus="stdlib", vocab_size=512, max_bytes=300_000, cache_dir=base["data_cache"]))
    try:
        whole = quality.run_one(quality.RunSpec(method="bf16", budget=None, warmup=1, **base))
        branch = quality.RunSpec(method="bf16", budget=None, warmup=4, prefix_steps=3, **base)
        first = quality.train_prefix(branch)
        assert not first["reused"] and quality.train_prefix(branch)["reused"]
        cont = quality.run_one(branch)
        assert cont["val_bf16"] == whole["val_bf16"]
        fp4 = quality.run_one(quality.RunSpec(**{**asdict(branch), "method": "uniform_fp4"}))
        assert fp4["fp4_fraction"] == 1.0 and fp4["val_bf16"] != whole["val_bf16"]
        steps = [json.loads(line)["step"] for line in
                 (tmp_path / "runs" / fp4["name"] / "metrics.jsonl").read_text().splitlines()]
        assert min(s for s in steps if s) == 4  # it trained only the steps after the prefix
        # The oracle's single-linear run: its pinned plan from the first step after the prefix on.
        single = quality.RunSpec(**{**asdict(branch), "method": "single_fp4", "fp4_linears": ("2.linear_fc1",)})
        one = quality.run_one(single)
        flops = flop_table(ModelShape(**model))
        key = LayerKey(2, "linear_fc1")
        assert one["fp4_fraction"] == pytest.approx(flops[key] / sum(flops.values()))
        assert one["val_bf16"] not in (whole["val_bf16"], fp4["val_bf16"])
        plan = Plan.load(single.plan_path)
        assert plan[key] is Precision.FP4 and sum(p is Precision.FP4 for p in plan.values()) == 1
        history = load_plan_history(tmp_path / "runs" / one["name"])
        assert history and all(p == plan for _, p in history)  # never re-planned
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("formats", ["nvfp4,mxfp4", "mxfp4,nvfp4", "mxfp4", "nvfp4"])
def test_every_run_gives_snip_and_the_trainer_the_same_formats(quality, formats):
    """`--formats mxfp4,nvfp4` crashed at its first run (the BF16 one: SNIP's config kept nvfp4
    while the trainer ran mxfp4). Every run, in every format order, now starts."""
    from types import SimpleNamespace

    from snip_megatron.controller import SnipController
    from snip_megatron.shapes import ModelShape

    args = quality.parse_args(["--formats", formats, "--quick"])
    for spec in quality.build_specs(args):
        snip, train = quality.snip_config(spec), quality.train_config(spec)
        assert snip.formats == train.formats, spec.name
        ctrl = SnipController(snip, ModelShape(**spec.model), total_steps=spec.steps, log=lambda m: None)
        ctrl.on_train_start(SimpleNamespace(formats=train.formats, step=0, set_plan=lambda plan: None))


def test_the_oracle_runs_singles_first_then_the_knapsack_of_their_harms(quality, tmp_path):
    args = quality.parse_args(["--layers", "2", "--seeds", "2", "--budgets", "0.5,0.75", "--other-budgets", "0.75",
                               "--run-dir", str(tmp_path)])
    specs = quality.build_specs(args)
    singles = [s for s in specs if s.method == "single_fp4"]
    # one run per linear, seed and format, each holding only its linear in FP4
    assert len(singles) == 8 * 2 * 2 and len({s.name for s in singles}) == len(singles)
    assert {s.fp4_linears for s in singles} == {(f"{layer}.{n}",) for layer in (1, 2) for n in
                                                ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}
    assert "nvfp4_single_2_linear_fc1_from400_s1" in {s.name for s in singles}
    assert quality.snip_config(singles[0]).pin_plan and quality.snip_config(singles[0]).plan == str(singles[0].plan_path)
    assert not any(s.method in quality.PINNED for s in quality.build_specs(quality.parse_args(["--quick"])))
    named = quality.build_specs(quality.parse_args(["--quick", "--layers", "2", "--methods", "oracle"]))
    assert {s.method for s in named} == {"bf16", "uniform_fp8", "single_fp4"}  # its harms need uniform FP8

    # Synthetic results: linear i's harm is i * 1e-3, except a strongly harmful 1.linear_fc1.
    shape_keys = [s.fp4_linears[0] for s in singles if s.seed == 0 and s.fp4_recipe == "nvfp4"]
    results = []
    for s in specs:
        if s.method in ("bf16", "uniform_fp8", "single_fp4"):
            val = {"bf16": 4.0, "uniform_fp8": 4.01}.get(s.method)
            if val is None:
                i = shape_keys.index(s.fp4_linears[0])
                val = 4.01 + (0.5 if s.fp4_linears[0] == "1.linear_fc1" else i * 1e-3)
            results.append({"name": s.name, "spec": asdict(s), "val_bf16": val, "val_plan": val,
                            "fp4_fraction": 0.1, "diverged": False})
    assert results[-1]["name"].startswith("mxfp4_single_") and results[-1]["name"].endswith("_s1")
    oracle, waiting = quality.oracle_specs(args, results[:-1])  # one single missing: its seed's oracle waits
    assert waiting == ["mxfp4_oracle_75_from400_s1"] and len(oracle) == 5
    oracle, waiting = quality.oracle_specs(args, results)
    assert not waiting and len(oracle) == 2 * 2 + 2  # nvfp4: 2 budgets, mxfp4: 1 (the other budgets)
    o = next(s for s in oracle if s.name == "nvfp4_oracle_75_from400_s0")
    assert "1.linear_fc1" not in o.fp4_linears and o.budget == 0.75
    from snip_megatron.plan import all_keys
    from snip_megatron.planner.flops import flop_table
    from snip_megatron.shapes import ModelShape

    flops = flop_table(ModelShape(**o.model))
    assert sum(flops[k] for k in all_keys(2) if str(k) in o.fp4_linears) >= 0.75 * sum(flops.values()) * (1 - 1e-9)

    # Resume: an oracle run counts only with the same FP4 set (the log stores the tuple as a list).
    log = tmp_path / "results.jsonl"
    other = quality.RunSpec(**{**asdict(o), "fp4_linears": o.fp4_linears[1:]})
    log.write_text(json.dumps({"name": o.name, "spec": asdict(o), "val_bf16": 4.02}) + "\n")
    assert [r["name"] for r in quality.load_finished(log, [o])] == [o.name]
    assert quality.load_finished(log, [other]) == []

    # The summary: each linear's harm, and the oracle's row and share in the RESULT line.
    results += [_result("oracle", 0.75, seed, 4.0 * 1.002, fmt="nvfp4", fp4=0.75) for seed in (0, 1)]
    results += [_result("snip_periodic", 0.75, seed, 4.0 * 1.004, fmt="nvfp4", fp4=0.75) for seed in (0, 1)]
    results += [_result("last_fraction", 0.75, seed, 4.0 * 1.006, fmt="nvfp4", fp4=0.75) for seed in (0, 1)]
    results += [_result("min_rel_error", 0.75, seed, 4.0 * 1.010, fmt="nvfp4", fp4=0.75) for seed in (0, 1)]
    for r in results:
        r["spec"].setdefault("fp4_linears", [])
    summary = quality.summarize(results, "nvfp4", [0.75], ("last_fraction", "min_rel_error"))
    assert summary["harms"]["1.linear_fc1"] == {0: pytest.approx(0.5 / 4), 1: pytest.approx(0.5 / 4)}
    assert summary["harms"]["1.linear_qkv"][0] == pytest.approx(0.0, abs=1e-12)
    assert quality.recipe_of(summary, 0.75) == "last_fraction"  # the better recipe
    line = quality.result_line(summary, ("last_fraction", "min_rel_error"))
    assert "oracle_gap_75=0.00200" in line and "oracle_share_75=0.500" in line and "oracle_share_80=nan" in line
    assert "recipe_gap_75=0.00600" in line
    table = quality.format_oracle(summary, [0.75])
    assert "| 75% | last_fraction | +0.600% | +0.400% | +0.200% | 2 | 0.50 |" in table
    assert "| 1.linear_fc1 | +12.500% ± 0.000% | 2 |" in table


@pytest.mark.launches
def test_the_oracle_trains_the_knapsack_of_the_singles_it_just_ran_and_resumes(quality, tmp_path):
    """End to end on a tiny model, as a user runs it: BF16, uniform FP8, the 4 singles, then the
    oracle's run at 50%, whose FP4 set is the knapsack over the logged singles' harms; a rerun with
    --resume trains nothing."""
    import subprocess

    from snip_megatron.shapes import ModelShape

    argv = [sys.executable, str(ROOT / "bench" / "quality.py"), "--methods", "oracle", "--layers", "1",
            "--hidden", "64", "--ffn", "128", "--heads", "4", "--groups", "2", "--vocab", "512", "--seq", "32",
            "--micro-batch-size", "2", "--max-bytes", "300000", "--steps", "6", "--prefix-steps", "3",
            "--seeds", "1", "--formats", "nvfp4", "--budgets", "0.5", "--data-cache", str(tmp_path / "data"),
            "--run-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "results.md")]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    log = tmp_path / "runs" / "results.jsonl"
    runs = [r for r in quality.read_log(log) if "spec" in r]
    assert sorted(r["spec"]["method"] for r in runs) == ["bf16", "oracle"] + ["single_fp4"] * 4 + ["uniform_fp8"]
    by = {r["spec"]["method"]: r for r in runs if r["spec"]["method"] != "single_fp4"}
    singles = {r["spec"]["fp4_linears"][0]: r["val_bf16"] for r in runs if r["spec"]["method"] == "single_fp4"}
    from quality_oracle import oracle_fp4_linears, single_harms

    shape = ModelShape(**by["oracle"]["spec"]["model"])
    expected = oracle_fp4_linears(single_harms(singles, by["uniform_fp8"]["val_bf16"]), shape, 0.5)
    assert tuple(by["oracle"]["spec"]["fp4_linears"]) == expected
    assert by["oracle"]["fp4_fraction"] >= 0.5
    assert "SNIP's share" in (tmp_path / "results.md").read_text() and "oracle_gap_75=nan" in first.stdout
    again = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "6 runs (6 already done), then up to 1 oracle runs" in again.stdout
    assert len([r for r in quality.read_log(log) if "spec" in r]) == len(runs)  # nothing ran again


def test_a_report_from_the_log_alone_needs_no_run_folders(quality, tmp_path):
    """--report-only on a fresh clone: the log is committed, the run folders are not."""
    argv = ["--quick", "--methods", "snip_periodic", "--seeds", "1", "--max-bytes", "300000", "--vocab", "512",
            "--data-cache", str(tmp_path / "data"), "--run-dir", str(tmp_path / "gone"),
            "--log", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "docs" / "results.md")]
    specs = quality.build_specs(quality.parse_args(argv))
    (tmp_path / "log.jsonl").write_text("".join(
        json.dumps({"name": s.name, "spec": asdict(s), "val_bf16": 4.0 + 0.01 * i, "val_plan": 4.0, "seconds": 1.0,
                    "fp4_fraction": 0.75, "diverged": False, "run_dir": str(tmp_path / "gone" / s.name)}) + "\n"
        for i, s in enumerate(specs)))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "quality_regimes.md").write_text("## Where FP4 hurts\n\nthe map\n")
    quality.main(argv + ["--report-only"])
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "| snip_periodic | 75% |" in text and "SNIP plan over training" not in text
    assert text.rstrip().endswith("the map")  # the regime map, included


def test_a_log_with_finished_runs_is_only_replaced_with_fresh(quality, tmp_path):
    log = tmp_path / "results.jsonl"
    log.write_text(json.dumps({"invocation": {"argv": [], "wall_s": 1.0, "prefix_s": 0.0, "runs": 0}}) + "\n")
    quality.refuse_to_replace(quality.parse_args(["--log", str(log)]))  # no runs in it: nothing to lose
    log.write_text(json.dumps({"name": "nvfp4_bf16_s0", "spec": {}, "val_bf16": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="already holds finished runs: pass --resume"):
        quality.refuse_to_replace(quality.parse_args(["--log", str(log)]))
    for flag in ("--resume", "--report-only", "--fresh"):
        quality.refuse_to_replace(quality.parse_args(["--log", str(log), flag]))
    with pytest.raises(SystemExit):
        quality.parse_args(["--log", str(log), "--fresh", "--resume"])


def test_model_option_runs_a_preset_with_its_experts(quality):
    """--model llama_tiny_moe8: its dimensions and experts (models.gpt.PRESET_MOE) in every run, its
    own run folder, log and report (a companion of docs/results.md); the oracle lists a dense model's
    linears, so it is refused by name."""
    from snip_megatron.models.gpt import PRESET_MOE
    from snip_megatron.shapes import PRESETS

    args = quality.parse_args(["--model", "llama_tiny_moe8", "--quick", "--hidden", "64"])
    preset = PRESETS["llama_tiny_moe8"]
    assert (args.layers, args.ffn, args.heads, args.hidden) == (preset.num_layers, preset.ffn_hidden_size,
                                                                preset.num_attention_heads, 64)
    assert args.moe == asdict(PRESET_MOE["llama_tiny_moe8"]) and args.moe["num_experts"] == 8
    assert (args.run_dir, args.out) == ("runs/quality_llama_tiny_moe8", "docs/results_llama_tiny_moe8.md")
    specs = quality.build_specs(args)
    assert specs and all(quality.moe_of(s) == PRESET_MOE["llama_tiny_moe8"] for s in specs)
    dense = quality.build_specs(quality.parse_args(["--quick", "--hidden", "64"]))
    assert all(s.moe is None for s in dense) and quality.parse_args([]).out == "docs/results.md"
    assert specs[0].prefix_dir != quality.RunSpec(**{**asdict(specs[0]), "moe": None}).prefix_dir
    with pytest.raises(SystemExit):
        quality.parse_args(["--model", "llama_tiny_moe8"])  # the full benchmark runs the oracle
    with pytest.raises(SystemExit):
        quality.parse_args(["--model", "llama_tiny_moe9"])
    assert quality.experts_text(args.moe).startswith("MoE (every layer): 8 experts of FFN 176, top-2")


def test_the_main_report_appends_its_companions(quality, tmp_path):
    (tmp_path / "quality_regimes.md").write_text("regimes")
    (tmp_path / "results_llama_tiny_moe8.md").write_text("moe")
    main = tmp_path / "results.md"
    assert [p.name for p in quality.companions(tmp_path, main)] == ["quality_regimes.md", "results_llama_tiny_moe8.md"]
    assert quality.companions(tmp_path, tmp_path / "results_llama_tiny_moe8.md")[-1].name == "quality_regimes.md"


def test_an_moe_run_trains_measures_and_plans_its_expert_units(quality, tmp_path):
    """The MoE model option end to end on a tiny size: SNIP from a shared BF16 prefix, planned at step 2
    of 3; its plan holds the expert units and meets the budget."""
    import torch

    from snip_megatron.models.gpt import PRESET_MOE
    from snip_megatron.report import load_plan_history

    threads = torch.get_num_threads()
    model = dict(name="quality_test", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=512, seq_length=32)
    moe = {**asdict(PRESET_MOE["llama_tiny_moe8"]), "ffn_hidden_size": 64}
    base = dict(seed=0, fp4_recipe="nvfp4", steps=3, warmup=2, prefix_steps=1, model=model, moe=moe,
                data_cache=str(tmp_path / "data"), max_bytes=300_000, micro_batch_size=2, run_dir=str(tmp_path / "runs"))
    from snip_megatron.data.prepare import DataConfig, prepare

    prepare(DataConfig(corpus="stdlib", vocab_size=512, max_bytes=300_000, cache_dir=base["data_cache"]))
    try:
        spec = quality.RunSpec(method="snip_periodic", budget=0.75, **base)
        assert not quality.train_prefix(spec)["reused"]
        snip = quality.run_one(spec)
    finally:
        torch.set_num_threads(threads)
    history = load_plan_history(tmp_path / "runs" / snip["name"])
    plan = history[-1][1]
    assert {str(k) for k in plan if "expert" in k.name} == {f"{l}.expert_fc{i}" for l in (1, 2) for i in (1, 2)}
    assert 0.7 <= snip["fp4_fraction"] <= 0.8 and math.isfinite(snip["val_bf16"]) and not snip["diverged"]


def test_the_report_in_docs_opens_with_what_it_answers(quality):
    """docs/results.md says what it answers on its first line after the title, as the generator
    writes it (a hand edit would be lost at the next --report-only)."""
    lines = (ROOT / "docs" / "results.md").read_text().splitlines()
    assert lines[0].startswith("# Quality at equal FP4 budgets") and lines[2] == quality.ANSWERS
