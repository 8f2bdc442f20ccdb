"""Settings: what a support rule reads, the run's Megatron-Core configs and the few facts beside them.

Every entry converts its user input at its edge (Megatron-LM's arguments through Megatron's own
`core_transformer_config_from_args` and friends, Bridge's ConfigContainer as it is, the compact
loop's TrainConfig through the TransformerConfig it builds) and hands the rules one Settings. A
rule names what it reads by path: `model.<TransformerConfig field>`, `ddp.<field>`,
`optimizer.<field>`, `checkpoint.<field>`, `dist.<field>`, `run.<RunFacts field>`,
`snip.<SnipConfig field>`. Each entry spells a path the way its user typed it (support.names).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

ENTRIES = ("megatron-lm", "bridge", "compact", "analyze")
"""The loops a run starts from, and snip-analyze (which starts Megatron-LM's loop on a checkpoint: the
rules of megatron-lm hold there too, and its own)."""
SECTIONS = ("model", "ddp", "optimizer", "checkpoint", "dist", "run", "snip")


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a rule needs that is no field of Megatron-Core's configs: the loop, the machine and a
    few loop settings."""

    entry: str
    """Which loop starts the run (ENTRIES)."""
    family: str = "gpt"
    """The model family the entry builds: gpt, hybrid, or another Bridge provider's class name."""
    backend: str = "emulated"
    """Planned-linear backend: emulated (SNIP's linears on Megatron's local spec) or te."""
    world_size: int = 1
    """Processes in the run."""
    hybrid_pattern: str | None = None
    """A HybridModel's layer pattern (Megatron-LM's --hybrid-layer-pattern, Bridge's field)."""
    dataloader_type: str | None = None
    """Megatron's data loader kind (single, cyclic, external; Bridge also 'batch')."""
    freeze_all_layers: bool = False
    """Megatron-LM's --freeze-all-layers (an argument, no config field): forward-only steps."""
    peft: bool = False
    """Bridge: a PEFT config wraps the model."""
    full_te_layer: bool = False
    """Bridge: use_transformer_engine_full_layer_spec (TE's fused TransformerLayer)."""
    comm_overlap_tp: bool = False
    """Bridge: comm_overlap.tp_comm_overlap (userbuffers), set apart from the model's field."""
    te_installed: bool = False
    """Transformer Engine imports here."""
    te_version: str | None = None
    """The installed Transformer Engine's version, on the TE backend (None elsewhere)."""
    te_environ: tuple[tuple[str, str], ...] = ()
    """The NVTE_* variables of the run's environment, (name, value) sorted: the switches TE reads
    (snip_megatron.te.environment)."""
    cuda: bool = False
    """A CUDA device is visible."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One run as the rules see it. `model` is the TransformerConfig the run builds (an
    MLATransformerConfig, or Bridge's provider, which is one); the other configs may be None where
    an entry has none (the compact loop has no OptimizerConfig)."""

    model: Any
    snip: Any
    run: RunFacts
    ddp: Any = None
    optimizer: Any = None
    checkpoint: Any = None
    dist: Any = None
    extra: dict = field(default_factory=dict)
    """Values a rule computed for its message (set by `with_extra`), e.g. a list of odd sizes."""

    def get(self, path: str, default: Any = None) -> Any:
        """The value at `section.field` (`default` where the section or field is absent)."""
        section, _, name = path.partition(".")
        if section not in SECTIONS:
            raise KeyError(f"unknown settings section {section!r} in {path!r}; valid: {', '.join(SECTIONS)}")
        obj = getattr(self, section)
        return default if obj is None else getattr(obj, name, default)

    def with_extra(self, **values) -> "Settings":
        return replace(self, extra={**self.extra, **values})

    def num(self, path: str, default: int = 1) -> int:
        """An integer setting, `default` where it is None or absent (Megatron's unset sizes)."""
        value = self.get(path)
        return int(value) if value is not None else default
