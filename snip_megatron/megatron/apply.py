"""Find the planned linears of live model chunks by global LayerKey, and re-apply a plan to them.

Works on what Megatron builds on any rank: one GPTModel or a list of chunks (VPP), wrapped in
Megatron DDP or not. Keys come from each enclosing `TransformerLayer.layer_number` (global,
1-based), so stage-local module paths under PP/VPP never matter here.
"""

from __future__ import annotations

import re

from dataclasses import dataclass

from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.megatron.quant_recipe import check_runnable, config_dict_for
from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory, InventoryEntry
from snip_megatron.models.registry import adapter, family_of
from snip_megatron.plan import LayerKey, Plan, PlanChange, forward_order
from snip_megatron.te.options import TEOptions
from snip_megatron.te.restored import notice as restored_notice
from snip_megatron.te.restored import requantize_restored
from snip_megatron.te.translate import precision_of_te_params


@dataclass(frozen=True)
class PlannedLinear:
    """A planned linear of this rank."""

    key: LayerKey
    """Global layer number and linear name."""
    chunk: int
    """Index of the model chunk holding it (0 without virtual pipelining)."""
    module_path: str
    """Its name in that chunk's `named_modules()` (stage-local layer index)."""
    module: object
    """The module itself."""
    entry: "InventoryEntry | None" = None
    """Its inventory entry (whole shape, parallel kind)."""

    def __iter__(self):
        # Unpacks as a (key, module) pair: `for key, module in list_planned_linears(chunks)`.
        return iter((self.key, self.module))


@dataclass(frozen=True)
class AppliedChange:
    """One linear whose precision `apply_plan` changed on this rank."""

    key: LayerKey
    module_path: str
    chunk: int
    old: "Precision | None"
    """None: the module had no precision of its own (e.g. a TE linear following the global autocast)."""
    new: Precision

    def as_plan_change(self) -> PlanChange:
        return PlanChange(self.key, self.old, self.new)


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def list_planned_linears(model) -> list[PlannedLinear]:
    """Every planned linear of this rank's chunk(s) (by the model family's adapter), in forward
    order of their global keys. An MoE expert unit on the SequentialMLP path lists each local
    expert's module under the unit's key."""
    found: list[PlannedLinear] = []
    seen: dict[LayerKey, tuple[int, str]] = {}
    family = adapter(family_of(_chunks(model)))
    for c, chunk in enumerate(_chunks(model)):
        for path, module, entry in family.planned_modules(chunk):
            key = entry.key
            if key in seen and not (entry.experts and seen[key][0] == c):  # one unit, several experts
                raise ValueError(f"{key} appears twice on this rank: chunk {seen[key][0]} {seen[key][1]!r} "
                                 f"and chunk {c} {path!r}")
            seen.setdefault(key, (c, path))
            found.append(PlannedLinear(key, c, path, module, entry))
    return sorted(found, key=lambda pl: forward_order(pl.key))  # modules register proj before qkv


def is_te_linear(module) -> bool:
    """Megatron's TE linears (TELinear, TELayerNormColumnParallelLinear, ...) by their interface."""
    return callable(getattr(module, "will_execute_quantized", None)) and hasattr(module, "finish_init")


def is_emulated_linear(module) -> bool:
    """SNIP's emulated linears: they carry a precision and can switch it."""
    return callable(getattr(module, "set_precision", None))


def precision_of(module) -> "Precision | None":
    """The precision a planned linear runs in now; None if it has none of its own."""
    if is_emulated_linear(module):
        p = getattr(module, "precision", None)
        return None if p is None else Precision.parse(p)
    if is_te_linear(module):
        params = getattr(module, "te_quant_params", None)
        return None if params is None else precision_of_te_params(params)
    return None


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    from packaging.version import Version

    from megatron.core import package_info

    return Version(package_info.__version__).release[:2]


class _ProbeRecipe:
    """Stands for a per-module recipe (a RecipeConfig) in the re-arm probe's config."""


def megatron_rearms_te_cache(config=None) -> bool:
    """Whether the installed Megatron's `MegatronModule.set_is_first_microbatch`, which its schedule
    calls on every model chunk at each step's first micro-batch (pipeline_parallel/schedules.py),
    re-arms `is_first_microbatch` on the TE modules of a model built from `config` (its fp8, fp4,
    use_kitchen and quant_recipe; default: a per-module recipe and nothing else, as SNIP builds).

    Found by behaviour, not by version: a probe module holding that config and one child with the
    attribute Megatron looks for (`is_first_microbatch = False`) calls the method; the flag must
    flip. megatron-core 0.19 re-arms for a `quant_recipe` (Megatron-LM 5389d147, #5642, 2026-07-11);
    0.16-0.18 only under a global fp8/fp4 or kitchen, and builds of main between 2026-06-03 and that
    fix already report 0.19.0."""
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer.module import MegatronModule

    if config is None:
        fields = SimpleNamespace(fp8=None, fp4=None, use_kitchen=False, quant_recipe=_ProbeRecipe())
    else:
        fields = SimpleNamespace(fp8=getattr(config, "fp8", None), fp4=getattr(config, "fp4", None),
                                 use_kitchen=getattr(config, "use_kitchen", False),
                                 quant_recipe=getattr(config, "quant_recipe", None))
    probe = MegatronModule(fields)
    probe.te_module = torch.nn.Module()
    probe.te_module.is_first_microbatch = False
    probe.set_is_first_microbatch()
    # compat: megatron-core 0.16-0.18 leave the probe's flag False (SNIP turns the cache off), 0.19 flips it
    return probe.te_module.is_first_microbatch is True


def megatron_refreshes_te_weights(config) -> bool:
    """Whether Megatron's schedule re-arms `is_first_microbatch` on the TE linears of a model built
    from `config` at each step's first micro-batch (`megatron_rearms_te_cache`), so TE re-quantizes
    each one's cached weight once per step (TE 2.14 `module/base.py` get_weight_workspace: refreshed
    only when that flag is None or True). Without it the cached FP8/FP4 weight of each module's first
    quantized forward would be used for every later step."""
    return megatron_rearms_te_cache(config)


def weight_cache_notice() -> "str | None":
    """The start-up line of a TE run on a Megatron whose schedule does not re-arm TE's weight cache
    for a per-module recipe (probed, `megatron_rearms_te_cache`); None on one that does."""
    if megatron_rearms_te_cache():
        return None
    from megatron.core import package_info

    return (f"megatron-core {package_info.__version__} does not re-arm TE's cached FP8/FP4 weights for a "
            "per-module recipe (probed: MegatronModule.set_is_first_microbatch left a probe module's "
            "is_first_microbatch False): SNIP turns the cache off on every TE linear of the model, the "
            "--te-precision-config-file ones too (each weight is quantized at every micro-batch)")


def keep_te_weights_fresh(module) -> bool:
    """Turn off TE's per-module weight cache on a TE linear whose model Megatron does not re-arm
    (Megatron's own switch, `disable_parameter_transpose_cache`: TE then quantizes the weight at
    every micro-batch). True when it was turned off."""
    if megatron_refreshes_te_weights(getattr(module, "config", None)):
        return False
    module.disable_parameter_transpose_cache = True
    return True


def _say(line: str) -> None:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def te_cached_modules(model) -> list:
    """Every module of this rank's chunk(s) whose weight cache Megatron's schedule re-arms and its
    `disable_parameter_transpose_cache` turns off (Megatron's TE linears and grouped linears):
    the planned ones and any a user's precision config quantizes."""
    return [m for chunk in _chunks(model) for m in chunk.modules()
            if hasattr(m, "is_first_microbatch") and hasattr(m, "disable_parameter_transpose_cache")]


def current_plan(model) -> Plan:
    """The plan this rank's chunk(s) run now (only linears that have a precision of their own)."""
    return Plan({pl.key: p for pl in list_planned_linears(model)
                 if (p := precision_of(pl.module)) is not None})


def _config_inventory(model) -> "Inventory | None":
    """The planned linears of the whole model the chunks' config describes (None without one)."""
    for chunk in _chunks(model):
        config = getattr(chunk, "config", None)
        if config is not None and isinstance(getattr(config, "num_layers", None), int):
            return gpt.of_config(config)
    return None


def match_context(module_path: str) -> MatchContext:
    """The MatchContext Megatron gives a module when it builds it: the layer number is the first
    `layers.<n>` of its path, None without one (megatron/core/quantization/utils.py
    get_quant_config_or_none, 0.19.2: lines 15-19); an MTP layer's is its `mtp.layers.<n>`."""
    found = re.search(r"layers\.(\d+)", module_path)
    return MatchContext(module_path, int(found.group(1)) if found else None)


def apply_plan(model, plan: Plan, *, sm: "int | None" = None, te_options: "TEOptions | None" = None,
               formats: Formats = Formats(), num_layers=None) -> list[AppliedChange]:
    """Set every planned linear of this rank to its precision in `plan`; returns what changed.

    Call it on every rank at the same step boundary (between optimizer step and next forward).
    The whole plan is checked first (against `num_layers`: the model's Inventory, or a dense GPT's
    layer count, default its config's; and every local linear
    must be plannable and have a precision the backend can run), so a bad plan is refused with
    ValueError before any module changes. Emulated linears switch through `set_precision`, TE
    linears through `finish_init` with the TEQuantizationParams of `formats` on `sm` (default:
    this GPU); every TE linear of the chunks keeps a fresh weight cache (`keep_te_weights_fresh`), and
    one holding a checkpoint's recipe builds its quantizers from the run's (`te.restored`).
    Parameters are untouched: optimizer state and checkpoints carry over.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"apply_plan needs a Plan, got {type(plan).__name__}")
    family = family_of(_chunks(model))
    if num_layers is None and family == gpt.FAMILY:  # the GPT the chunks' config describes
        num_layers = _config_inventory(model)
    if num_layers is not None:
        plan.check_model(num_layers)
    linears = list_planned_linears(model)

    emulated_configs = te_configs = None
    todo = []
    for pl in linears:  # check everything before touching anything
        if pl.key not in plan:
            raise ValueError(f"plan has no precision for {pl.key} (chunk {pl.chunk} {pl.module_path!r})")
        new = plan[pl.key]
        if is_emulated_linear(pl.module):
            if emulated_configs is None:
                emulated_configs = config_dict_for("emulated", formats=formats)
            config = emulated_configs[new.value]
        elif is_te_linear(pl.module):
            if te_configs is None:
                te_configs = config_dict_for("te", sm=sm, te_options=te_options, formats=formats)
                check_runnable(plan, te_configs, backend="te", sm=sm, formats=formats)
            config = te_configs[new.value]
        else:
            raise ValueError(f"{pl.key} ({pl.module_path!r}) is a {type(pl.module).__name__}, which "
                             f"cannot switch precision; build with the SNIP or TE layer spec")
        todo.append((pl, new, config))

    for module in te_cached_modules(model):  # planned or not: Megatron re-arms them all, or none
        keep_te_weights_fresh(module)
    restored = restored_notice(requantize_restored(m for chunk in _chunks(model) for m in chunk.modules()))
    if restored is not None:  # a resume under another TE environment (on TE 2.14-2.17.0)
        _say(f"[snip] {restored}")
    changes: list[AppliedChange] = []
    for pl, new, config in todo:
        old = precision_of(pl.module)
        if old is new:
            continue
        if is_emulated_linear(pl.module):
            pl.module.set_precision(new, formats)
        else:
            pl.module.finish_init(QuantizationConfig(config, match_context(pl.module_path), new.value))
        if not any(c.key == pl.key for c in changes[-1:]):  # an expert unit's experts: one change
            changes.append(AppliedChange(pl.key, pl.module_path, pl.chunk, old, new))
    return changes
