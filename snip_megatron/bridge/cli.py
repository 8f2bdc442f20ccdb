"""snip-bridge-pretrain: a Megatron-Bridge recipe, trained by Bridge's pretrain() with SNIP.

    torchrun --nproc-per-node 8 -m snip_megatron.bridge \\
        --recipe megatron.bridge.recipes.llama.llama3:llama3_8b_pretrain_config \\
        snip.fp4_budget=0.75 snip.interval=1000 train.train_iters=100000 checkpoint.save=/ckpt

`--recipe MODULE:FUNCTION` builds Bridge's ConfigContainer (any recipe function that takes no
argument); `--config-file` (a YAML of the same shape) and then the `KEY=VALUE` overrides change it
with Bridge's own override syntax (`process_config_with_overrides`, Hydra's grammar). Overrides and
YAML entries under `snip.` go to SNIP's settings (SnipConfig, enabled by default; `snip.enabled=false`
trains the recipe as it is) and are validated by SnipConfig after all of them are applied. A bad
setting, or a package Bridge needs that is missing here, exits with status 2 and one message naming
the field or what to install; nothing starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass, field

from snip_megatron.config import SnipConfig

PROG = "snip-bridge-pretrain"
DEFAULT_FORWARD_STEP = "megatron.bridge.training.gpt_step:forward_step"


@dataclass
class SnipOverrides:
    """What `snip.*` overrides are applied to (then rebuilt, so SnipConfig validates the result)."""

    snip: SnipConfig = field(default_factory=lambda: SnipConfig(enabled=True))
    """SNIP's settings, SNIP on."""


class UsageError(ValueError):
    """A command-line or configuration error: exit status 2, its message, no traceback."""


TE_IMPORTER = "megatron.bridge.peft.lora_layers"
"""The Bridge module that imports Transformer Engine unguarded (Megatron-Bridge 0.6.2): reached by
`import megatron.bridge`, so Bridge cannot be imported without TE (or a stand-in for this module,
as the bridge lane's tests put in sys.modules)."""


def require_bridge() -> None:
    """The absences that stop Megatron-Bridge from importing, named before anything imports it (no
    half-imported Bridge, no screen of warnings): UsageError naming what to install."""
    import importlib.util

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a missing parent package
            return False

    if not installed("megatron.bridge"):
        raise UsageError("Megatron-Bridge is not installed here: pip install megatron-bridge (0.6.2 tested)")
    if TE_IMPORTER not in sys.modules and not installed("transformer_engine"):
        raise UsageError(TE_MISSING)


def import_bridge() -> None:
    """Import Megatron-Bridge; a module it misses (one `require_bridge` does not know) is named."""
    try:
        import megatron.bridge  # noqa: F401
    except ModuleNotFoundError as e:
        missing = (e.name or "?").split(".")[0]
        raise UsageError(TE_MISSING if missing == "transformer_engine" else
                         f"Megatron-Bridge cannot be imported: no module named {e.name!r}; install {missing}") from None


TE_MISSING = ("Megatron-Bridge needs Transformer Engine (it imports transformer_engine.pytorch in "
              "megatron/bridge/peft/lora_layers.py), which is not installed here: run in an NGC PyTorch "
              "container, or pip install --no-build-isolation transformer_engine[pytorch] on a CUDA machine; "
              "without a GPU, train with snip-pretrain-gpt (Megatron-LM's loop) instead")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--recipe", required=True, metavar="MODULE:FUNCTION",
                   help="Bridge recipe function returning a ConfigContainer, e.g. "
                        "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config")
    p.add_argument("--config-file", default=None, metavar="YAML",
                   help="YAML overrides of the recipe (a top-level `snip:` mapping goes to SnipConfig)")
    p.add_argument("--forward-step", default=DEFAULT_FORWARD_STEP, metavar="MODULE:FUNCTION",
                   help="Bridge forward step (default: %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Bridge overrides (train.train_iters=100) and SNIP's (snip.fp4_budget=0.75)")
    return p


def load_object(spec: str, what: str):
    """`module:attribute` -> the object; UsageError naming `what` when it is not there."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise UsageError(f"{what} must be MODULE:FUNCTION, got {spec!r}")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise UsageError(f"{what} {spec!r}: cannot import {module} ({e})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what} {spec!r}: {module} has no {name}")
        obj = getattr(obj, part)
    return obj


def is_snip_key(override: str) -> bool:
    """Whether a Hydra override (`key=value`, `+key=value`, `~key`) sets one of SNIP's settings."""
    return override.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "snip"


def split_yaml(path: str, workdir: str) -> "tuple[str | None, str | None]":
    """A YAML of overrides -> (Bridge's part, SNIP's part), each written as its own file (or None)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"--config-file {path}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config-file {path}: a YAML mapping of config sections is needed")
    snip = data.pop("snip", None)
    parts = []
    for name, part in (("bridge.yaml", data), ("snip.yaml", {"snip": snip} if snip is not None else None)):
        if not part:
            parts.append(None)
            continue
        out = os.path.join(workdir, name)
        with open(out, "w") as f:
            yaml.safe_dump(part, f)
        parts.append(out)
    return parts[0], parts[1]


def apply_overrides(target, yaml_path, overrides: list, what: str):
    """Bridge's process_config_with_overrides; its errors (unknown keys, bad syntax) as UsageError."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    try:
        return process_config_with_overrides(target, config_filepath=yaml_path, cli_overrides=overrides or None)
    except Exception as e:  # OverridesError, ConfigKeyError, ValidationError, ...
        raise UsageError(f"{what}: {type(e).__name__}: {e}".strip()) from None


def snip_config(yaml_path, overrides: list) -> SnipConfig:
    """SNIP's settings after the YAML's `snip:` part and the `snip.*` overrides, validated."""
    holder = apply_overrides(SnipOverrides(), yaml_path, overrides, "snip overrides")
    try:
        return SnipConfig.from_dict(dataclasses.asdict(holder.snip))
    except ValueError as e:
        raise UsageError(str(e)) from None


def configure(argv: list) -> tuple:
    """(ConfigContainer, SnipConfig, forward step) from the command line; UsageError on any problem."""
    from megatron.bridge.training.config import ConfigContainer

    args = parser().parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise UsageError(f"overrides are KEY=VALUE, got {bad[0]!r}")
    snip_overrides = [o for o in args.overrides if is_snip_key(o)]
    bridge_overrides = [o for o in args.overrides if not is_snip_key(o)]
    recipe = load_object(args.recipe, "--recipe")
    forward_step = load_object(args.forward_step, "--forward-step")
    with tempfile.TemporaryDirectory(prefix="snip-bridge-") as workdir:
        bridge_yaml, snip_yaml = split_yaml(args.config_file, workdir) if args.config_file else (None, None)
        snip = snip_config(snip_yaml, snip_overrides)  # first: a bad snip.* fails before the recipe runs
        cfg = recipe()
        if not isinstance(cfg, ConfigContainer):
            raise UsageError(f"--recipe {args.recipe} returned a {type(cfg).__name__}, not a ConfigContainer")
        cfg = apply_overrides(cfg, bridge_yaml, bridge_overrides, "Bridge overrides")
    return cfg, snip, forward_step


def main(argv: "list[str] | None" = None) -> int:
    """Configure, set SNIP up and run Bridge's pretrain(); 2 on a configuration error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser().parse_args(argv)  # --help and a malformed command line need nothing installed
        require_bridge()
        from snip_megatron.megatron.startup import quiet_startup

        quiet_startup()  # one line per expected absence, before Bridge imports megatron.core
        import_bridge()
        cfg, snip, forward_step = configure(argv)
        from snip_megatron.bridge.enable import enable_snip

        callbacks = enable_snip(cfg, snip)
    except (UsageError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from megatron.bridge.training.pretrain import pretrain

    pretrain(cfg, forward_step, callbacks=callbacks)
    return 0


def cli() -> None:
    """Console entry point `snip-bridge-pretrain`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
