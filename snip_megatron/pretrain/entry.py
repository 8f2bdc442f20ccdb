"""snip-pretrain-gpt / snip-pretrain-hybrid: Megatron-LM's GPT or HybridModel pretraining
(`megatron.training.pretrain`) with SNIP.

    torchrun --nproc-per-node 8 -m snip_megatron.pretrain <Megatron-LM arguments> \\
        --snip --snip-fp4-budget 0.75 --snip-interval 1000
    torchrun --nproc-per-node 8 -m snip_megatron.pretrain.hybrid --hybrid-layer-pattern '*-*-|*-*-' \\
        --transformer-impl transformer_engine <Megatron-LM arguments> --snip

Megatron-LM's own pretrain_gpt main, as a patched checkout runs it: `gpt_config_from_args` builds
the model config (Megatron's builder and layer spec, every model flag), `setup_megatron_lm` adds
SNIP, and `pretrain` runs Megatron's loop with Megatron-LM's GPT forward step and datasets
(snip_megatron.pretrain.data, which also takes `--corpus` text). Takes every Megatron-LM argument
plus the `--snip*` flags (generated from SnipConfig) and the data flags. Runs on CPU (gloo) too.
"""

from __future__ import annotations

import argparse
import os
import sys


def require_megatron_training() -> None:
    """MissingDependency (one line, exit 2 through run_cli) where megatron.training is missing
    (megatron-core < 0.19)."""
    from snip_megatron.errors import MissingDependency

    # compat: megatron.training ships with megatron-core >= 0.19; 0.16 (the compat lane) gets this refusal.
    try:
        import megatron.training  # noqa: F401
        from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: F401
    except Exception as e:  # ImportError, or a broken optional dependency behind it
        try:
            import megatron.core as mcore
            have = f"megatron-core {mcore.__version__}"
        except Exception:
            have = "no megatron-core"
        raise MissingDependency(
            f"Megatron-LM's loop needs megatron.training (shipped with megatron-core >= 0.19); this "
            f"environment has {have} ({type(e).__name__}: {e}): pip install 'megatron-core>=0.19', or "
            "use a Megatron-LM checkout with patches/megatron-lm-pretrain_gpt.patch") from None


def add_extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `extra_args_provider` of this entry point: SNIP flags and data flags."""
    from snip_megatron.megatron.args import add_snip_args
    from snip_megatron.pretrain.data import add_data_args

    return add_data_args(add_snip_args(parser))


PROGRAMS = {"gpt": "snip-pretrain-gpt", "hybrid": "snip-pretrain-hybrid"}
"""The console script of each model family's Megatron-LM main."""


def main(argv: "list[str] | None" = None, controller=None, family: str = "gpt") -> int:
    """Parse Megatron + SNIP arguments, set SNIP up and run `megatron.training.pretrain` on
    Megatron-LM's model config of `family` ("gpt": pretrain_gpt.py's `gpt_config_from_args`;
    "hybrid": pretrain_hybrid.py's `hybrid_config_from_args`, a HybridModel of
    --hybrid-layer-pattern). `controller`: a stand-in for SnipController (tests). Bad input raises
    ValueError naming it (`cli` prints it in one line and exits 2)."""
    args = parse_megatron_args(argv, prog=PROGRAMS[family])
    if args is None:
        return 0
    run_pretrain(args, controller=controller, family=family)
    return 0


def parse_megatron_args(argv: "list[str] | None" = None, prog: str = "snip-pretrain-gpt"):
    """Megatron-LM's parsed and validated arguments, with SNIP's and the data flags (None after
    `--help`): the SNIP flags checked first, on their own, so a bad one fails in a second, not
    after Megatron's start-up; on CPU the CPU flags go first, on a GPU the flags for the fused
    kernels it lacks (the user's own still win)."""
    from snip_megatron.megatron.startup import quiet_startup

    quiet_startup()  # before anything imports megatron.core: one line per expected absence
    require_megatron_training()
    import torch

    from snip_megatron.megatron.args import add_snip_args, snip_config_from_args
    from snip_megatron.pretrain import cpu

    argv = list(sys.argv[1:] if argv is None else argv)
    early = add_snip_args(argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False))
    snip_config_from_args(early.parse_known_args(argv)[0])
    if not torch.cuda.is_available():
        argv = cpu.cpu_flags() + argv
        cpu.patch_arguments_for_cpu()
        # Megatron requires this with TP > 1 (a CUDA stream setting); meaningless on CPU.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    else:  # a GPU without TE or apex (e.g. --transformer-impl local for FP4 on Hopper)
        argv = cpu.gpu_flags() + argv
    sys.argv = [sys.argv[0]] + argv  # Megatron parses sys.argv
    import warnings

    warnings.filterwarnings("ignore", message=".*model provider.*")
    from megatron.training.arguments import parse_and_validate_args

    if "-h" in argv or "--help" in argv:
        print_help(prog)
        return None
    return parse_and_validate_args(extra_args_provider=add_extra_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})


def model_config(args, family: str = "gpt"):
    """Megatron-LM's model config of `family` from its parsed `args` (pretrain_gpt.py's
    `gpt_config_from_args`, pretrain_hybrid.py's `hybrid_config_from_args`), after refusing what
    SNIP cannot run (before Megatron builds anything) and, on CPU, setting the CPU's flags."""
    import torch
    from megatron.training.argument_utils import gpt_config_from_args, hybrid_config_from_args

    from snip_megatron.pretrain import cpu
    from snip_megatron.pretrain.setup import check_run

    check_run(args, family)
    if not torch.cuda.is_available():
        cpu.prepare_cpu(args)
    return (hybrid_config_from_args if family == "hybrid" else gpt_config_from_args)(args)


def run_pretrain(args, controller=None, family: str = "gpt", model_cfg=None) -> None:
    """SNIP set up on Megatron's parsed `args`, then Megatron-LM's `pretrain` with its GPT
    datasets and forward step, on the model config of `family` (see `main`; `model_cfg`: the one
    `model_config` gave, default made here)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from snip_megatron.pretrain import cpu
    from snip_megatron.pretrain.data import datasets_provider, forward_step
    from snip_megatron.pretrain.setup import start

    if model_cfg is None:
        model_cfg = model_config(args, family)
    start(args, model_cfg, controller=controller)
    cpu.skip_prebuilt_helpers()
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), datasets_provider,
             ModelType.encoder_or_decoder, forward_step)


def print_help(prog: str = "snip-pretrain-gpt") -> None:
    """Megatron-LM's arguments and SNIP's, as `--help` shows them. (A stray '%' in one of
    Megatron's own help texts makes argparse's help fail; it is escaped here.)"""
    import re

    from megatron.training.arguments import add_megatron_arguments

    parser = add_extra_args(add_megatron_arguments(argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)))
    for action in parser._actions:
        if action.help:
            action.help = re.sub(r"%%|%\(\w+\)\w|%", lambda m: "%%" if m.group() == "%" else m.group(),
                                 action.help)
    parser.print_help()


def cli() -> None:
    """Console entry point `snip-pretrain-gpt`."""
    from snip_megatron.errors import run_cli

    sys.exit(run_cli("snip-pretrain-gpt", main))


def main_hybrid(argv: "list[str] | None" = None, controller=None) -> int:
    """`main` for Megatron-LM's pretrain_hybrid.py (a HybridModel of --hybrid-layer-pattern)."""
    return main(argv, controller, family="hybrid")


def cli_hybrid() -> None:
    """Console entry point `snip-pretrain-hybrid`."""
    from snip_megatron.errors import run_cli

    sys.exit(run_cli("snip-pretrain-hybrid", main_hybrid))


if __name__ == "__main__":
    cli()
