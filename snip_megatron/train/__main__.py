"""Train a model on real text with the compact Megatron-Core loop.

    python -m snip_megatron.train --model llama_tiny --steps 200 --metrics runs/tiny.jsonl
    torchrun --standalone --nproc_per_node 2 -m snip_megatron.train --model llama_tiny --tp 2 --steps 50

Prints a progress bar, then `RESULT first_val_loss=... final_val_loss=... tokens_per_s=...`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from snip_megatron.megatron.startup import quiet_startup

quiet_startup()  # before anything imports megatron.core: one line per expected absence

from snip_megatron.config import SnipConfig  # noqa: E402
from snip_megatron.controller import SnipController
from snip_megatron.data.prepare import DataConfig
from snip_megatron.flags import add_dataclass_flags, values_of
from snip_megatron.loggers import RunLoggers
from snip_megatron.megatron.args import add_snip_args, snip_config_from_args
from snip_megatron.shapes import PRESETS, get_shape
from snip_megatron.megatron.spec import BACKENDS
from snip_megatron.train.config import PARAM_DTYPES, TrainConfig
from snip_megatron.train.loop import Trainer

# Flags whose name is not the field's (kept for the command lines users already have).
_TRAIN_FLAGS = {"metrics_path": "--metrics"}
_DATA_FLAGS = {"cache_dir": "--data-cache"}


def build_parser() -> tuple[argparse.ArgumentParser, dict, dict]:
    """The compact loop's parser: TrainConfig's and DataConfig's fields and the --snip* flags, all
    generated from the dataclasses (snip_megatron.flags)."""
    p = argparse.ArgumentParser(prog="python -m snip_megatron.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama_tiny", choices=list(PRESETS),
                   help="model preset (snip_megatron.shapes.PRESETS; llama_tiny_mla: multi-latent attention, "
                        "llama_tiny_moe, llama_tiny_moe8: MoE layers)")
    train = add_dataclass_flags(p, TrainConfig, exclude=("model", "mla", "moe", "data", "formats"),
                                flag_of=lambda n: _TRAIN_FLAGS.get(n, "--" + n.replace("_", "-")),
                                choices={"backend": BACKENDS, "params_dtype": PARAM_DTYPES})
    data = add_dataclass_flags(p.add_argument_group("data"), DataConfig, defaults={"vocab_size": None},
                               flag_of=lambda n: _DATA_FLAGS.get(n, "--" + n.replace("_", "-")))
    add_snip_args(p)
    p.add_argument("--run-dir", default=None,
                   help="folder for the SNIP plan log (snip_plans.jsonl) and the report; default: "
                        "beside --metrics")
    return p, train, data


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, SnipConfig, "str | None"]:
    """(TrainConfig, the resolved SnipConfig, the run folder)."""
    parser, train_dests, data_dests = build_parser()
    args = parser.parse_args(argv)
    data_values = values_of(args, data_dests)
    data_values["vocab_size"] = data_values["vocab_size"] or get_shape(args.model).vocab_size
    snip = snip_config_from_args(args)
    values = values_of(args, train_dests)
    values["eval_interval"] = values["eval_interval"] or None  # --eval-interval 0: no validation
    if snip.enabled:
        snip = snip.resolved("emulated")
    train = TrainConfig(model=args.model, data=DataConfig(**data_values), formats=snip.formats, **values)
    run_dir = args.run_dir or (str(Path(train.metrics_path).parent) if train.metrics_path else None)
    return train, snip, run_dir


def main(argv: list[str] | None = None) -> int:
    config, snip, run_dir = parse_args(argv)
    hooks = []
    loggers = RunLoggers(enabled=config.tensorboard_dir is not None)  # its writers: the Trainer's, below
    if snip.enabled:
        hooks.append(SnipController(snip, config.shape, total_steps=config.steps, run_dir=run_dir,
                                    tokens_per_step=config.micro_batch_size * config.seq_len,
                                    loggers=loggers, inventory=config.inventory))
    trainer = Trainer(config, hooks=hooks)
    loggers.writers = trainer.figure_writers
    history = trainer.fit()
    if trainer.is_reporter:
        vals = [m["val_loss"] for m in history if "val_loss" in m]
        speeds = [m["tokens_per_s"] for m in history if "tokens_per_s" in m]
        first = f"{vals[0]:.4f}" if vals else "nan"
        last = f"{vals[-1]:.4f}" if vals else "nan"
        tps = f"{statistics.median(speeds):.0f}" if speeds else "nan"
        print(f"RESULT first_val_loss={first} final_val_loss={last} tokens_per_s={tps} "
              f"steps={trainer.step}", flush=True)
    trainer.close()
    return 0


if __name__ == "__main__":
    from snip_megatron.errors import run_cli

    sys.exit(run_cli("python -m snip_megatron.train", main))
