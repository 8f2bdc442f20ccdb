"""A Plan as Megatron's `TransformerConfig.quant_recipe`: a matcher keyed by global layer number.

Megatron (0.16.1 and 0.19.2) calls `get_quant_config_or_none(name, config.quant_recipe)` for every
module with `finish_init` at the end of `GPTModel.__init__`. `name` is the module path inside
that model chunk, e.g. `decoder.layers.3.<linear>`, where 3 is the index *local to the
pipeline stage / virtual chunk*, 0-based; `MatchContext.layer_number` is that same local index
(parsed from the path), not the global `TransformerLayer.layer_number`. A Plan is keyed by the
global 1-based layer number, so each chunk's matcher carries that chunk's layer offset.
"""

from __future__ import annotations

from megatron.core.quantization.quant_config import MatchContext, Matcher, RecipeConfig

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.models import gpt
from snip_megatron.models.registry import adapter
from snip_megatron.plan import LayerKey, Plan
from snip_megatron.te.gpu import current_sm
from snip_megatron.te.options import TEOptions
from snip_megatron.te.translate import emulated_params, te_config_dict, te_unavailable

QUANT_BACKENDS = ("emulated", "te")
"""Planned-linear backends that read a quant_recipe (the third, "local", runs Megatron's plain linears)."""

def parse_planned_path(module_path: str) -> "tuple[int, str] | None":
    """(stage-local 0-based layer index, linear name) of a planned linear's path, else None
    (the GPT adapter's rule: an MoE layer's local experts are its expert units; MTP layers: keys
    of their own, `key_for_path`)."""
    return gpt.parse_path(module_path)


def key_for_path(module_path: str, layer_offset: int) -> "LayerKey | None":
    """The global LayerKey of a module path in a chunk whose first layer is `layer_offset` + 1."""
    return gpt.key_for_path(module_path, layer_offset)


class PlanMatcher(Matcher):
    """Matches the planned linears of one model chunk to the config key of their precision.

    First match wins in a RecipeConfig, so other matchers (e.g. a GlobMatcher for modules the
    plan does not cover) may follow it.
    """

    def __init__(self, plan: Plan, *, layer_offset: int = 0, family: str = gpt.FAMILY):
        """`family`: the model family whose module paths this chunk has (`models.registry`)."""
        self._key_for_path = adapter(family).key_for_path
        if not isinstance(plan, Plan):
            raise ValueError(f"PlanMatcher needs a Plan, got {type(plan).__name__}")
        if not isinstance(layer_offset, int) or isinstance(layer_offset, bool) or layer_offset < 0:
            raise ValueError(f"layer_offset must be a non-negative integer, got {layer_offset!r}")
        self.plan = plan
        self.layer_offset = layer_offset
        self.family = family

    def key_for(self, module_path: str) -> "LayerKey | None":
        return self._key_for_path(module_path, self.layer_offset)

    def match(self, context: MatchContext) -> "str | None":
        key = self.key_for(context.module_path)
        if key is None:
            return None
        if key not in self.plan:
            # Never fall back silently: a linear left at the global default would mis-state the plan.
            raise ValueError(f"plan has no precision for {key} (module {context.module_path!r}, "
                             f"layer offset {self.layer_offset}); the plan covers layers "
                             f"1..{self.plan.num_layers}")
        return self.plan[key].value

    def __repr__(self) -> str:
        family = "" if self.family == gpt.FAMILY else f", family={self.family!r}"
        return f"PlanMatcher(plan={self.plan!r}, layer_offset={self.layer_offset}{family})"

    def to_cfg_dict(self) -> dict:
        """Plain, instantiable form: Megatron-Bridge writes every model config (quant_recipe
        included) into each checkpoint's run_config.yaml, and needs this of a custom matcher."""
        cfg = {"_target_": f"{__name__}.PlanMatcher.from_cfg", "plan": self.plan.to_dict(),
               "layer_offset": self.layer_offset}
        if self.family != gpt.FAMILY:  # a GPT run's run_config.yaml stays as it was
            cfg["family"] = self.family
        return cfg

    @classmethod
    def from_cfg(cls, plan, layer_offset: int = 0, family: str = gpt.FAMILY) -> "PlanMatcher":
        """Inverse of `to_cfg_dict` (the plan as `Plan.to_dict` writes it)."""
        return cls(plan if isinstance(plan, Plan) else Plan.from_dict(plan), layer_offset=layer_offset,
                   family=family)


def config_dict_for(backend: str = "emulated", *, sm: "int | None" = None,
                    te_options: "TEOptions | None" = None, formats: Formats = Formats()) -> dict[str, dict]:
    """{precision name: config dict} that the planned linears of `backend` read in finish_init.

    backend='emulated': SNIP's emulated linears ({"precision": "fp4", "fp4_recipe": "nvfp4"}).
    backend='te': TEQuantizationParams dicts in `formats` for compute capability `sm` (default:
    this GPU, `snip_megatron.te.gpu.current_sm`); a precision TE cannot run there is absent.
    """
    if backend == "emulated":
        return {p.value: emulated_params(p, formats) for p in Precision}
    if backend == "te":
        return te_config_dict(formats=formats, sm=current_sm() if sm is None else sm,
                              options=te_options or TEOptions())
    raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(QUANT_BACKENDS)}")


def check_runnable(plan: Plan, configs: dict, *, backend: str, sm: "int | None",
                   formats: Formats) -> None:
    """ValueError naming each precision of `plan` that `configs` (config_dict_for's) lacks, and why."""
    missing = sorted({p.value for p in plan.values()} - set(configs))
    if not missing:
        return
    reasons = te_unavailable(formats=formats, sm=current_sm() if sm is None else sm) if backend == "te" else {}
    raise ValueError("the plan puts linears in " + "; ".join(
        f"{name}, which the {backend} backend cannot run here: {reasons.get(name, 'no config')}"
        for name in missing))


def build_recipe(plan: Plan, *, layer_offset: int = 0, backend: str = "emulated",
                 num_layers: "int | None" = None, sm: "int | None" = None,
                 te_options: "TEOptions | None" = None, formats: Formats = Formats(),
                 family: str = gpt.FAMILY) -> RecipeConfig:
    """Plan -> RecipeConfig for one model chunk (`layer_offset`: global layers before it) of a
    model of `family` (its module paths: `models.registry`).

    With `num_layers`, the plan must cover exactly that model's planned linears (ValueError
    otherwise), so a mismatched plan is refused before any module is configured; so is a plan
    with a precision the backend cannot run on this GPU.
    """
    if num_layers is not None:
        plan.check_model(num_layers)
    if backend == "te" and sm is None:
        sm = current_sm()
    configs = config_dict_for(backend, sm=sm, te_options=te_options, formats=formats)
    check_runnable(plan, configs, backend=backend, sm=sm, formats=formats)
    return RecipeConfig(matchers=[PlanMatcher(plan, layer_offset=layer_offset, family=family)],
                        config_dict=configs)


def layer_offset(config, *, vp_stage: "int | None" = None, pp_rank: "int | None" = None) -> int:
    """Global layers before this chunk, by Megatron's own `get_transformer_layer_offset`
    (even split, uneven first/last stage, embedding/loss accounting, custom layouts).

    `pp_rank` defaults to this process's pipeline rank; it is 0 without pipelining.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pp_rank is None and config.pipeline_model_parallel_size == 1:
        pp_rank = 0
    return int(get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank))


def recipe_for_chunk(plan: Plan, config, *, vp_stage: "int | None" = None,
                     pp_rank: "int | None" = None, **kwargs) -> RecipeConfig:
    """`build_recipe` for the chunk (`vp_stage`) of this rank's pipeline stage, checking the plan
    against the model `config` describes. Set it as `config.quant_recipe` before building that chunk."""
    kwargs.setdefault("num_layers", gpt.of_config(config))
    return build_recipe(plan, layer_offset=layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank),
                        **kwargs)
