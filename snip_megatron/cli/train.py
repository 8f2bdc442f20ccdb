"""snip-train: compose a Hydra recipe, check its layout, print or run the exact launch command.

    snip-train                                              # llama_tiny, mock data, SNIP default
    snip-train model=llama_7b parallel=tp4_pp2 snip.fp4_budget=0.8 --dry-run
    snip-train --print-command model=llama_7b parallel=tp4_pp2   # for launch/*.sh: one arg a line

The tiny recipe runs the compact loop (`python -m snip_megatron.train ...`); bigger ones run
`snip-pretrain-gpt` (Megatron-LM's loop) with the recipe as Megatron arguments. --dry-run prints
the command of any recipe, with a placeholder for what only the cluster knows (a multi-node run's
rendezvous endpoint, unless given); --print-command and a real run need it.
"""

from __future__ import annotations

import argparse
import os
import sys

from snip_megatron.errors import run_cli

RDZV_PLACEHOLDER = "<HOST:PORT>"
"""What --dry-run prints for a multi-node run's rendezvous endpoint when none is given."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snip-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides: group=option or a.b=value")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved recipe and the launch command; run nothing")
    p.add_argument("--print-target", action="store_true",
                   help="print the training target (what follows torchrun's options), one argument a line")
    p.add_argument("--print-command", action="store_true",
                   help="print the whole launch command, one argument a line (for launch/*.sh)")
    p.add_argument("--config-dir", default=None, help="recipe folder (default: $SNIP_CONFIG_DIR or ./configs)")
    p.add_argument("--config-name", default="config", help="top recipe file without .yaml (default config)")
    p.add_argument("--rdzv-endpoint", default=os.environ.get("SNIP_RDZV_ENDPOINT"),
                   help="host:port of the c10d rendezvous for multi-node runs")
    p.add_argument("--rdzv-id", default=os.environ.get("SNIP_RDZV_ID"), help="rendezvous id (multi-node)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Raises ValueError for bad input (`cli` prints it in one line and exits 2)."""
    opts = build_parser().parse_args(argv)
    # The recipe's modules import torch and megatron.core: after quiet_startup (`cli`) and --help.
    from snip_megatron.cli.command import launch_command, shell_line, training_target
    from snip_megatron.cli.recipe import check_input_files, compose_config, to_recipe

    cfg = compose_config(opts.overrides, config_dir=opts.config_dir, config_name=opts.config_name)
    from omegaconf import OmegaConf

    resolved_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    recipe = check_input_files(to_recipe(cfg))  # a dry run checks them too
    if opts.print_target:
        print("\n".join(training_target(recipe)))
        return 0
    placeholder = opts.dry_run and recipe.parallel.nnodes > 1 and not opts.rdzv_endpoint
    cmd = launch_command(recipe, rdzv_endpoint=RDZV_PLACEHOLDER if placeholder else opts.rdzv_endpoint,
                         rdzv_id=opts.rdzv_id)
    if opts.print_command:
        print("\n".join(cmd))
        return 0
    if opts.dry_run:
        print("# resolved recipe")
        print(resolved_yaml.rstrip())
        print(f"# entry: {recipe.entry}; world size {recipe.parallel.world_size} = "
              f"tp {recipe.parallel.tp} x pp {recipe.parallel.pp} x dp {recipe.parallel.data_parallel_size}")
        if placeholder:
            print(f"# {RDZV_PLACEHOLDER}: the c10d rendezvous endpoint of the job's first node, known on the "
                  "cluster (--rdzv-endpoint or SNIP_RDZV_ENDPOINT; launch/slurm.sbatch sets it)")
        print("# launch command")
        print(shell_line(cmd))
        return 0
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)  # replaces this process: signals and exit codes reach the trainer directly
    return 0  # not reached


def cli() -> None:
    """Console entry point `snip-train`."""
    from snip_megatron.megatron.startup import quiet_startup

    quiet_startup()  # before the recipe's imports reach megatron.core: one line per expected absence
    sys.exit(run_cli("snip-train", main))


if __name__ == "__main__":
    cli()
