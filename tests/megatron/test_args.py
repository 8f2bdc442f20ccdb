"""The --snip* flags: generated from SnipConfig (one per field, its docstring as help), parsing,
validation with the flag's name, round trip to a launch line, and (where megatron.training exists)
coexistence with every Megatron-LM argument."""

import argparse

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.megatron import add_snip_args
from dataclasses import fields

from snip_megatron.flags import field_docs
from snip_megatron.megatron.args import flag_of, snip_args_from_config, snip_config_from_args

FLAGS = {f.name: flag_of(f.name) for f in fields(SnipConfig)}


def parse(*argv):
    parser = add_snip_args(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False))
    return parser.parse_args(list(argv))


@pytest.fixture(autouse=True)
def saved_plans(tmp_path, monkeypatch):
    """plan.json and p.json in the working folder: --snip-plan files exist as they are parsed."""
    from snip_megatron.plan import Plan

    monkeypatch.chdir(tmp_path)
    for name in ("plan.json", "p.json"):
        Plan.uniform(2, "fp8").save(tmp_path / name)


def test_defaults_match_snipconfig():
    cfg = snip_config_from_args(parse())
    assert cfg == SnipConfig()


def test_every_field_has_a_flag_with_its_docstring_as_help():
    parser = add_snip_args(argparse.ArgumentParser())
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    docs = field_docs(SnipConfig)
    assert set(docs) == {f.name for f in fields(SnipConfig)}  # every field is documented
    for name, flag in FLAGS.items():
        assert flag in by_option, flag
        assert by_option[flag].help.replace("%%", "%").startswith(docs[name]), flag
    assert FLAGS["enabled"] == "--snip" and FLAGS["fp4_budget"] == "--snip-fp4-budget"
    choice = by_option["--snip-fp4-recipe"]
    assert tuple(choice.choices) == ("nvfp4", "mxfp4") and choice.default == SnipConfig().fp4_recipe


def test_flags_reach_the_config():
    cfg = snip_config_from_args(parse(
        "--snip", "--snip-fp4-budget", "0.8", "--snip-interval", "500", "--snip-lag", "5",
        "--snip-warmup", "200", "--snip-precisions", "bf16,fp8,fp4", "--snip-fp8-recipe", "mxfp8",
        "--snip-fp4-recipe", "mxfp4", "--snip-per-stage-budget", "--snip-lambda-wd", "0.5"))
    assert cfg.enabled and cfg.fp4_budget == 0.8 and cfg.interval == 500 and cfg.lag == 5
    assert cfg.warmup_steps(10_000) == 200
    assert cfg.precisions == ["bf16", "fp8", "fp4"]
    assert (cfg.fp8_recipe, cfg.fp4_recipe) == ("mxfp8", "mxfp4")
    assert cfg.per_stage_budget and cfg.lambda_wd == 0.5


def test_plan_or_baseline_enables_snip():
    assert snip_config_from_args(parse("--snip-baseline", "uniform_fp8")).enabled
    assert snip_config_from_args(parse("--snip-baseline", "first_last_k", "--snip-baseline-relax")).baseline_relax
    cfg = snip_config_from_args(parse("--snip-plan", "plan.json", "--snip-pin-plan"))
    assert cfg.enabled and cfg.pin_plan and not cfg.measures


@pytest.mark.parametrize("argv, message", [
    (["--snip-fp4-budget", "lots"], "--snip-fp4-budget"),
    (["--snip-fp8-recipe", "delayed"], "--snip-fp8-recipe"),
    (["--snip-baseline", "best"], "--snip-baseline"),
])
def test_values_of_the_wrong_type_or_choice_are_rejected_by_the_parser(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        parse(*argv)


@pytest.mark.parametrize("argv, message", [
    (["--snip-fp4-budget", "1.2"], "--snip-fp4-budget must be a fraction in"),
    (["--snip-interval", "0"], "--snip-interval must be a positive integer"),
    (["--snip-warmup", "12.5"], "--snip-warmup=12.5 is >= 1, so it is a step count"),
    (["--snip-precisions", "fp8,int8"], "--snip-precisions has unknown precision 'int8'"),
    (["--snip-plan", "missing.json"], "--snip-plan missing.json: no such file"),
])
def test_bad_values_are_refused_as_they_parse_naming_the_flag(argv, message):
    """SnipConfig's rule for the field, in the flag's argparse type (check_field)."""
    with pytest.raises(argparse.ArgumentError, match=message):
        parse(*argv)


def test_an_error_is_one_line_without_the_usage(capsys):
    parser = add_snip_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--snip-fp4-budget", "1.5"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --snip-fp4-budget must be a fraction in [0, 1], got 1.5\n"
    with pytest.raises(SystemExit):
        parser.parse_args(["--no-such-flag"])  # not SNIP's: argparse's own usage and error
    assert capsys.readouterr().err.startswith("usage: pretrain_gpt.py")


@pytest.mark.parametrize("argv, message", [
    (["--snip", "--snip-lag", "20", "--snip-interval", "10"], "--snip-lag=20 must be smaller than --snip-interval"),
    (["--snip", "--snip-pin-plan"], "--snip-pin-plan is set but --snip-plan is empty"),
    (["--snip-plan", "p.json", "--snip-pin-plan", "--snip-baseline", "random"], "--snip-pin-plan and --snip-baseline"),
    (["--snip", "--snip-precisions", "bf16,fp4"], "--snip-initial-precision='fp8' is not one of"),
    (["--snip", "--snip-loss-guard-factor", "0.9"], "--snip-loss-guard-factor"),
])
def test_bad_combinations_name_the_flags(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message):  # refused as the parse ends
        parse(*argv)


def test_launch_line_round_trip():
    cfg = SnipConfig(enabled=True, fp4_budget=0.9, interval=500, warmup=300, precisions=["bf16", "fp8", "fp4"],
                     per_stage_budget=True, baseline="last_fraction", baseline_fraction=0.2)
    line = snip_args_from_config(cfg)
    assert line[0] == "--snip" and "--snip-per-stage-budget" in line
    assert line[line.index("--snip-warmup") + 1] == "300"
    assert snip_config_from_args(parse(*line)) == cfg
    assert snip_args_from_config(SnipConfig()) == []  # off: no flags at all
    assert snip_args_from_config(SnipConfig(enabled=True)) == ["--snip"]


def test_megatron_parser_takes_the_snip_flags():
    """The flags added to Megatron-LM's own parser: no clash with its ~850 options."""
    pytest.importorskip("megatron.training.arguments",
                        reason="megatron.training ships only with megatron-core >= 0.19 (prod lane)")
    from megatron.training.arguments import add_megatron_arguments

    parser = add_snip_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(["--num-layers", "2", "--snip", "--snip-fp4-budget", "0.6"])
    assert args.num_layers == 2
    assert snip_config_from_args(args).fp4_budget == 0.6


def test_every_flag_is_documented():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "megatron-lm.md").read_text()
    missing = [flag for flag in FLAGS.values() if f"`{flag}" not in page]
    assert not missing, f"docs/megatron-lm.md does not document {missing}"
