"""SNIP's command-line flags for Megatron-LM (`extra_args_provider`), generated from SnipConfig.

    from snip_megatron.megatron import add_snip_args
    args = parse_and_validate_args(extra_args_provider=add_snip_args)
    snip = snip_config_from_args(args)

One flag per SnipConfig field, `--snip-<field>` (`enabled` is `--snip`), with the field's type,
default, choices (`snip_megatron.config.CHOICES`) and docstring as its help (snip_megatron.flags).
The flags only parse; SnipConfig validates, and its errors name the flag. Import-light (argparse and
the config only), so a Megatron-LM checkout can import it before Megatron is initialised.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from snip_megatron.config import CHOICES, SnipConfig, check_field
from snip_megatron.flags import add_dataclass_flags, one_line_errors, values_of

_DEFAULTS = SnipConfig()
_FLAG_NAMES = {"enabled": "--snip", "solver_time_limit_s": "--snip-solver-time-limit"}
"""The flags whose name is not `--snip-<field>` (kept for the command lines users already have)."""


def flag_of(field_name: str) -> str:
    """The command-line flag of a SnipConfig field."""
    return _FLAG_NAMES.get(field_name, "--snip-" + field_name.replace("_", "-"))


_DESTS = {f.name: flag_of(f.name)[2:].replace("-", "_") for f in fields(SnipConfig)}


def add_snip_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--snip*` flags to Megatron's parser (its `extra_args_provider`); returns the parser.

    Each value is checked as it is parsed (`check_flag`), and how they combine once the parse is
    done (`snip_config_from_args`): a bad one stops the parse with one line naming the flag, exit
    status 2, before Megatron validates or prints its own arguments."""
    group = parser.add_argument_group(
        title="SNIP", description="adaptive per-layer FP8/FP4 precision (snip-megatron); each flag "
                                  "sets the SnipConfig field of its name")
    add_dataclass_flags(group, SnipConfig, flag_of=flag_of, choices=CHOICES,
                        metavars={"plan": "PATH", "solver_time_limit_s": "SECONDS"}, check=check_flag)
    if isinstance(parser, argparse.ArgumentParser):
        one_line_errors(parser, "--snip")
        _check_when_parsed(parser)
    return parser


def _check_when_parsed(parser: argparse.ArgumentParser) -> None:
    """After `parser` parses (parse_args goes through parse_known_args), the --snip* values
    together: a combination SnipConfig refuses ends the parse with its one line, exit 2 (an
    ArgumentError with the same message for a parser made with exit_on_error=False)."""
    parse_known_args = parser.parse_known_args

    def parse_and_check(*args, **kwargs):
        namespace, extras = parse_known_args(*args, **kwargs)
        try:
            snip_config_from_args(namespace)
        except ValueError as e:
            if not parser.exit_on_error:
                raise argparse.ArgumentError(None, str(e)) from None
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        return namespace, extras

    parser.parse_known_args = parse_and_check


def check_flag(name: str, value) -> None:
    """The parse-time check of one `--snip*` value: SnipConfig's rule for that field alone, and
    `--snip-plan` must be a file here. ValueError naming the flag."""
    try:
        check_field(name, value)
    except ValueError as e:
        raise ValueError(named_as_flags(str(e))) from None
    if name == "plan" and not Path(value).is_file():
        raise ValueError(f"--snip-plan {value}: no such file; give the path of a saved plan (JSON/YAML; "
                         "`python -m snip_megatron.report export RUN_DIR --format json` writes one), "
                         "or drop --snip-plan")


def snip_config_from_args(args: argparse.Namespace) -> SnipConfig:
    """SnipConfig from parsed flags; a bad value or combination raises ValueError naming the flag(s).

    `--snip-plan` or `--snip-baseline` without `--snip` still enables SNIP's layers: asking for a
    plan is asking to run it.
    """
    values = values_of(args, _DESTS)
    if values["plan"] is not None or values["baseline"] is not None:
        values["enabled"] = True
    try:
        return SnipConfig(**values)
    except ValueError as e:
        raise ValueError(f"bad SNIP flags: {named_as_flags(str(e))}") from None


def named_as_flags(message: str) -> str:
    """`message` with every `SnipConfig.<field>` written as its flag (for SnipConfig's errors)."""
    for name in sorted(_DESTS, key=len, reverse=True):  # baseline_k before baseline
        message = message.replace(f"SnipConfig.{name}", flag_of(name))
    return message


def snip_args_from_config(cfg: SnipConfig) -> list[str]:
    """The flags that reproduce `cfg` (only those that differ from the defaults), for launch lines."""
    if not cfg.enabled:
        return []
    out = ["--snip"]
    for f in fields(SnipConfig):
        if f.name == "enabled":
            continue
        v, default = getattr(cfg, f.name), getattr(_DEFAULTS, f.name)
        if isinstance(v, (list, tuple)):
            v, default = list(v), None if default is None else list(default)
        if v == default:
            continue
        flag = flag_of(f.name)
        if isinstance(v, bool):
            out.append(flag)
        elif isinstance(v, list):
            out += [flag, ",".join(v)]
        elif isinstance(v, float) and v == int(v) and f.name == "warmup":
            out += [flag, str(int(v))]
        else:
            out += [flag, str(v)]
    return out
