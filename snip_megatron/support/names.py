"""How each entry spells a setting: the name its user typed, how to drop it, how to set it.

- Megatron-LM (`--flags`): a config field's argument, through the renames Megatron-LM's own
  converters make (`core_transformer_config_from_args`: `num_moe_experts` is `--num-experts`, ...),
  then the flag Megatron's parser gives that argument (`--fp8-format` for `fp8`).
- Megatron-Bridge (`section.field`): the ConfigContainer's own paths; a field a mixed-precision
  recipe sets is that recipe's (it overwrites the model's when pretrain() starts).
- The compact loop (`python -m snip_megatron.train`): its few flags; what it has no flag for, its
  user cannot set.
"""

from __future__ import annotations

import functools

from snip_megatron.megatron.args import flag_of as snip_flag_of

MEGATRON_LM_ARGS = {
    "model.num_moe_experts": "num_experts",
    "model.fp8_param": "fp8_param_gather",
    "model.fp4_param": "fp4_param_gather",
    "model.num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "model.num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "model.virtual_pipeline_model_parallel_size": "num_layers_per_virtual_pipeline_stage",
    "run.hybrid_pattern": "hybrid_layer_pattern",
    "run.dataloader_type": "dataloader_type",
    "run.freeze_all_layers": "freeze_all_layers",
    "run.backend": "snip_backend",
    "dist.use_torch_fsdp2": "use_torch_fsdp2",
}
"""Settings whose Megatron-LM argument has another name (megatron/training/argument_utils.py
`core_transformer_config_from_args`, 0.19.2: `kw_args['num_moe_experts'] = args.num_experts`, ...;
the virtual pipeline size is computed from --num-layers-per-virtual-pipeline-stage in validate_args).
Every other `section.field` is Megatron-LM's argument `field`."""

WORLD = "the number of processes (WORLD_SIZE)"
_CONFIG_CLASS = {"model": "TransformerConfig", "ddp": "DistributedDataParallelConfig", "optimizer": "OptimizerConfig",
                 "checkpoint": "CheckpointConfig", "dist": "DistributedInitConfig"}


FACTS = ("run.world_size", "run.cuda", "run.te_installed", "run.te_version", "run.te_environ")
"""Facts of the machine and the launch, which no entry's settings set (TE's environment switches are
the launch's environment variables)."""


class Names:
    """The default spelling (a config path as it is); entries override `name`."""

    entry = "config"

    def name(self, path: str) -> str:
        return path

    def reaches(self, path: str) -> bool:
        """Whether this entry's user can set `path` (the machine's facts count as set)."""
        return True

    def drop(self, path: str, value) -> str:
        return f"drop {self.name(path)}"

    def set(self, path: str, literal: str) -> str:
        return f"{self.name(path)} {literal}"


class MegatronLMNames(Names):
    """Megatron-LM's flags (snip-pretrain-gpt, snip-pretrain-hybrid, a patched pretrain_gpt.py)."""

    entry = "megatron-lm"

    def name(self, path: str) -> str:
        section, _, field = path.partition(".")
        if path == "run.world_size":
            return WORLD
        if section == "snip":
            return snip_flag_of(field)
        if path == "run.backend":
            return "--snip-backend (with --transformer-impl)"
        dest = MEGATRON_LM_ARGS.get(path, field)
        flags = megatron_lm_flags()
        if flags and dest not in flags:  # a config field Megatron-LM has no flag for (a script sets it)
            return f"{_CONFIG_CLASS.get(section, section)}.{field} (no Megatron-LM flag)"
        return flags.get(dest, "--" + dest.replace("_", "-"))

    def set(self, path: str, literal: str) -> str:
        flag = self.name(path)
        if literal == "True":
            return flag
        return f"{flag} {literal}"

    def reaches(self, path: str) -> bool:
        return path in FACTS or path in ("run.backend", "run.family") or self.name(path).startswith("--")


@functools.lru_cache(maxsize=1)
def megatron_lm_flags() -> dict:
    """{argument: its flag} of Megatron-LM's parser with SNIP's flags; {} where megatron.training
    is missing (megatron-core < 0.19, where Megatron-LM's loop cannot run either)."""
    import argparse

    try:
        from megatron.training.arguments import add_megatron_arguments
    except Exception:  # megatron-core < 0.19, or a broken optional dependency
        return {}
    from snip_megatron.megatron.args import add_snip_args

    parser = add_snip_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    out = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in out:
            out[action.dest] = longs[0]
    return out


class BridgeNames(Names):
    """Megatron-Bridge's ConfigContainer paths (enable_snip, snip-bridge-pretrain's KEY=VALUE)."""

    entry = "bridge"

    def __init__(self, mixed_precision: "str | None" = None, mixed_fields: frozenset = frozenset()):
        self.mixed_precision = mixed_precision
        """The name of the mixed-precision recipe that acts, if any."""
        self.mixed_fields = mixed_fields
        """The model/ddp/optimizer fields that recipe sets (they are its, not the model's)."""

    _PATHS = {"run.hybrid_pattern": "model.hybrid_layer_pattern", "run.dataloader_type": "dataset.dataloader_type",
              "run.peft": "peft", "run.full_te_layer": "model.use_transformer_engine_full_layer_spec",
              "run.comm_overlap_tp": "comm_overlap.tp_comm_overlap", "run.backend": "model.transformer_impl",
              "run.world_size": WORLD}

    def name(self, path: str) -> str:
        if path in self._PATHS:
            return self._PATHS[path]
        section, _, field = path.partition(".")
        if self.mixed_precision and field in self.mixed_fields and section in ("model", "ddp", "optimizer"):
            return f"mixed_precision={self.mixed_precision!r} (its {field})"
        return path

    def drop(self, path: str, value) -> str:
        name = self.name(path)
        if name.startswith("mixed_precision="):
            return "use mixed_precision='bf16_mixed' (or None)"
        return f"set {name}={False if isinstance(value, bool) else None}"

    def set(self, path: str, literal: str) -> str:
        value = literal if literal in ("True", "False", "None") or literal.lstrip("-").isdigit() else repr(literal)
        return f"{self.name(path)}={value}"


class CompactNames(Names):
    """The compact loop's flags (`python -m snip_megatron.train`, snip-train's train.entry=compact)."""

    entry = "compact"
    _FLAGS = {"model.tensor_model_parallel_size": "--tp", "model.pipeline_model_parallel_size": "--pp",
              "ddp.use_distributed_optimizer": "--distributed-optimizer", "run.backend": "--backend",
              "model.transformer_impl": "--backend",
              "model.num_moe_experts": "--model (an MoE preset: llama_tiny_moe, llama_tiny_moe8)",
              "model.multi_latent_attention": "--model llama_tiny_mla (multi-latent attention)",
              "run.world_size": WORLD}

    _VALUES = {"model.transformer_impl": {"transformer_engine": "te", "local": "emulated"}}
    """Values the compact loop's flag spells its own way (--backend te builds TE linears)."""

    def name(self, path: str) -> str:
        section, _, field = path.partition(".")
        if section == "snip":
            return snip_flag_of(field)
        return self._FLAGS.get(path, f"TransformerConfig.{field} (no flag of the compact loop)")

    def set(self, path: str, literal: str) -> str:
        return f"{self.name(path)} {self._VALUES.get(path, {}).get(literal, literal)}"

    def reaches(self, path: str) -> bool:
        return path in FACTS or path in self._FLAGS or path.startswith("snip.") or path == "model.moe_router_topk"


class ExportNames(CompactNames):
    """`python -m snip_megatron.report export`'s flags: --backend te|emulated, --hybrid-layer-pattern."""

    entry = "export"
    _FLAGS = {"model.transformer_impl": "--backend", "run.backend": "--backend",
              "run.hybrid_pattern": "--hybrid-layer-pattern"}


def names_for(entry: str) -> Names:
    """The default spelling of each entry (Bridge's without a mixed-precision recipe)."""
    return {"megatron-lm": MegatronLMNames, "analyze": MegatronLMNames, "bridge": BridgeNames,
            "compact": CompactNames, "export": ExportNames}[entry]()
