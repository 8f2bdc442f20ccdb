"""A run's plan as a static per-module precision config: for Megatron-LM, Megatron-Bridge, or JSON.

    python -m snip_megatron.report export RUN_DIR --format megatron|bridge|json [--step N] [--out FILE]
                                          [--hybrid-layer-pattern PATTERN] [--pp N [--vpp V]]

The plan is the final one of `RUN_DIR/snip_plans.jsonl`, or with `--step N` the one in force at
step N (the last plan applied at or before N). Formats:

- `megatron`: the YAML Megatron-LM's `--te-precision-config-file` reads
  (`megatron.core.quantization.utils.load_quantization_recipe`): one config per precision and one
  glob matcher per planned linear, its exact module path (`decoder.layers.<i>.<submodule>.<linear>`);
- `bridge`: the same recipe as a Megatron-Bridge config override, `model.quant_recipe` with
  `_target_`s (Bridge's run_config.yaml form): `--config-file FILE` of a Bridge script or of
  snip-bridge-pretrain, or `process_config_with_overrides(cfg, FILE)`;
- `json`: the plan itself (`Plan.to_dict`, plus the step and the source), which `snip.plan` /
  `--snip-plan` read (pin it with `snip.pin_plan` / `--snip-pin-plan`).

Every planned linear of the model's inventory gets its matcher: a GPT's attention (dense or
multi-latent: its q/kv down- and up-projections) and MLP linears, an MoE layer's routed-expert
units (one glob, `decoder.layers.<i>.mlp.experts.*linear_fc1`, matching TE's grouped linear and
every local expert of a SequentialMLP) and shared experts, the multi-token-prediction layers
(`mtp.layers.<k-1>.eh_proj`, `mtp.layers.<k-1>.mtp_model_layer.<linear>`); a HybridModel's layers
(`--hybrid-layer-pattern`, the run's: each symbol its own layer, whose kind names the linear's
module, e.g. a Mamba layer's `mixer.in_proj`, and whose '|' segments are the pipeline stages).

Module paths carry the layer index *local to the pipeline stage* (and virtual chunk), and one file
configures every rank, so a matcher cannot tell layer 1 of the first stage from layer 1 of the
second. The megatron and bridge exports are therefore for one layout: PP=1 by default, or
`--pp N [--vpp V]` (Megatron's even split; a HybridModel's '|' segments, one per chunk, so
N x V of them). For PP > 1 the export is written only when every stage-local path gets one
precision across all stages that have it, and refused otherwise, naming the path and the layers
that disagree (train with PP=1 paths in mind, export the JSON plan and pin it, or keep SNIP's own
matcher, which knows each chunk's offset); MTP layers keep their own paths on the last stage. The
configs are Transformer Engine's (`--backend te`: what a SNIP run on SM`--sm`, default 100, gives
its TE linears in TE's default environment) or SNIP's emulated linears' (`--backend emulated`; not
for a HybridModel, whose layer spec is TE's); a recipe TE cannot run on that GPU (FP4 and MXFP8
before SM100, MXFP4) is refused with the reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.models import gpt
from snip_megatron.plan import Plan
from snip_megatron.run_files import load_plan_history

FORMATS = ("megatron", "bridge", "json")
DEFAULT_NAMES = {"megatron": "snip_precision_config.yaml", "bridge": "snip_quant_recipe.yaml",
                 "json": "snip_plan.json"}
"""Output file in the run folder when `--out` is not given."""


def plan_at(run_dir: "str | Path", step: "int | None" = None) -> tuple[int, Plan]:
    """(step it was applied, plan) of the run's final plan, or of the plan in force at `step`."""
    history = load_plan_history(Path(run_dir))
    if step is None:
        return history[-1]
    before = [(s, p) for s, p in history if s <= step]
    if not before:
        raise ValueError(f"--step {step}: the run's first plan was applied at step {history[0][0]}")
    return before[-1]


def _chunks(num_layers: int, pp: int, vpp: "int | None", pattern: "str | None" = None) -> list[tuple[int, int]]:
    """(layer offset, layers) of every model chunk: a GPT's by Megatron's own split, a HybridModel's
    by its pattern's segments (Megatron's select_pipeline_segment)."""
    if pattern is not None:
        from snip_megatron.models import hybrid

        cut = len(hybrid.parse_pattern(pattern))
        if cut > 1 and cut != pp * (vpp or 1):
            raise ValueError(f"--hybrid-layer-pattern {pattern!r} has {cut} '|' segments, one per model chunk, but "
                             f"PP={pp}" + (f" x VPP={vpp}" if vpp else "") + f" has {pp * (vpp or 1)} chunks: "
                             f"export with --pp and --vpp whose product is {cut} (Megatron-LM reads VPP as "
                             "segments / PP), or without '|' for PP=1")
        segments = [hybrid.segment(pattern, rank, pp, vp) for vp in (range(vpp) if vpp else [None])
                    for rank in range(pp)]
        return [(offset, len(symbols)) for offset, symbols in segments]
    if pp == 1 and vpp is None:
        return [(0, num_layers)]
    from snip_megatron.megatron.layout import chunk_layers, layout_config
    from snip_megatron.shapes import ModelShape

    # Only the layer count matters to the split; the other fields just make a valid config.
    shape = ModelShape(name="export", num_layers=num_layers, hidden_size=64, ffn_hidden_size=64,
                       num_attention_heads=1, num_query_groups=1)
    config = layout_config(shape, pp=pp, vpp=vpp)
    return [chunk_layers(config, rank, vp) for rank in range(pp) for vp in (range(vpp) if vpp else [None])]


def module_glob(key, layer_offset: int = 0, pattern: "str | None" = None) -> str:
    """The glob matching the module(s) of a plan's `key` in the chunk whose first layer is
    `layer_offset` + 1: a GPT's (an expert unit: every local expert too; an MTP linear: its own
    path, on whichever stage holds it), or with `pattern` a HybridModel's; ValueError naming what
    the plan's key is not."""
    from snip_megatron.models import hybrid

    if pattern is not None:
        return hybrid.module_pattern(key, pattern, layer_offset)
    if key.name not in gpt.SLOTS:
        raise ValueError(f"the plan's {key} is not a GPT linear: a HybridModel's plan needs --hybrid-layer-pattern "
                         "(the run's)")
    return gpt.module_pattern(key, layer_offset)


def path_precisions(plan: Plan, *, pp: int = 1, vpp: "int | None" = None,
                    pattern: "str | None" = None) -> dict[str, Precision]:
    """Stage-local module path -> precision for the layout (`pattern`: a HybridModel's layer
    pattern); ValueError where one path would need two precisions (see the module docstring)."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"--pp must be a positive integer, got {pp!r}")
    if vpp is not None and (pp < 2 or not isinstance(vpp, int) or vpp < 1):
        raise ValueError(f"--vpp {vpp} needs --pp >= 2 and a positive integer")
    out: dict[str, Precision] = {}
    seen: dict[str, list] = {}
    decoder = [(k, p) for k, p in plan.items() if not gpt.is_mtp(k)]
    placed = set()
    for offset, count in _chunks(max((k.layer for k, _ in decoder), default=0), pp, vpp, pattern):
        for key, precision in decoder:
            if offset < key.layer <= offset + count:
                path = module_glob(key, offset, pattern)
                seen.setdefault(path, []).append((key, precision))
                out.setdefault(path, precision)
                placed.add(key)
    if len(placed) < len(decoder):  # never drop a planned linear silently
        lost = ", ".join(str(k) for k, _ in decoder if k not in placed)
        over = f" over --hybrid-layer-pattern {pattern!r}" if pattern else ""
        raise ValueError(f"no model chunk of PP={pp}" + (f" VPP={vpp}" if vpp else "") + f"{over} holds the plan's "
                         f"{lost}" + (" (the pattern is not the run's)" if pattern else ""))
    for path, entries in seen.items():
        if len({p for _, p in entries}) > 1:
            detail = ", ".join(f"layer {k.layer} {p.value}" for k, p in entries)
            raise ValueError(f"the plan cannot be written as one per-module config for PP={pp}"
                             + (f" VPP={vpp}" if vpp else "") + f": {path} is {detail} on the stages "
                             "that hold it, and a matcher sees only the stage-local path. Export for "
                             "PP=1, or use --format json with snip.plan / --snip-plan (SNIP's matcher "
                             "knows each chunk's layer offset)")
    # multi-token prediction: its own layer numbers, on the last stage
    out.update({module_glob(k): p for k, p in plan.items() if gpt.is_mtp(k)})
    return out


def precision_configs(precisions, *, backend: str = "te", sm: int = 100, fp8_recipe: "str | None" = None,
                      fp4_recipe: str = "nvfp4") -> dict[str, dict]:
    """{precision name: the config dict a planned linear reads in finish_init}, for those precisions.

    TE configs are those a SNIP run on SM`sm` would give its TE linears in TE's default
    environment (`te.resolve.te_formats`: no FP4 before SM100); a recipe TE cannot run there is
    refused with the reason."""
    from snip_megatron.te.resolve import te_formats
    from snip_megatron.te.translate import emulated_params, te_config_dict

    names = sorted({Precision.parse(p).value for p in precisions}, key=[p.value for p in Precision].index)
    fp8_recipe = fp8_recipe or Formats().fp8_recipe
    if backend == "emulated":
        formats = Formats(fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        return {n: emulated_params(n, formats) for n in names}
    if backend != "te":
        raise ValueError(f"--backend {backend!r} is unknown; valid: te, emulated")
    formats = te_formats(fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe, sm=sm, uses=names, environ={},
                         name_of=lambda f: "--" + f.replace("_", "-"))
    configs = te_config_dict(formats=formats, sm=sm)
    return {n: configs[n] for n in names}


def megatron_config(paths: dict[str, Precision], configs: dict[str, dict]) -> dict:
    """The `--te-precision-config-file` document (RecipeConfig.from_config_dict's layout)."""
    matchers = {f"snip_{i:04d}": {"type": "glob", "pattern": path, "config": p.value, "enabled": True}
                for i, (path, p) in enumerate(paths.items())}
    return {"configs": configs, "matchers": matchers}


def bridge_config(paths: dict[str, Precision], configs: dict[str, dict]) -> dict:
    """A Bridge config override setting `model.quant_recipe` (instantiated from its `_target_`s)."""
    from megatron.core.quantization.quant_config import GlobMatcher, RecipeConfig

    glob = f"{GlobMatcher.__module__}.{GlobMatcher.__qualname__}"
    recipe = {"_target_": f"{RecipeConfig.__module__}.{RecipeConfig.__qualname__}",
              "matchers": [{"_target_": glob, "pattern": path, "config_key": p.value} for path, p in paths.items()],
              "config_dict": configs}
    return {"model": {"quant_recipe": recipe}}


def _check_supported(pattern: "str | None", backend: str) -> None:
    """The model x backend rules of snip_megatron.support (a HybridModel's linears are TE's), as
    `report export` spells them; ValueError with the first."""
    from types import SimpleNamespace

    from snip_megatron.support.check import refusals
    from snip_megatron.support.names import ExportNames
    from snip_megatron.support.settings import RunFacts, Settings

    facts = RunFacts(entry="export", family="hybrid" if pattern else "gpt", backend=backend, hybrid_pattern=pattern)
    impl = "transformer_engine" if backend == "te" else "local"
    refused = refusals(Settings(model=SimpleNamespace(transformer_impl=impl), snip=None, run=facts), ExportNames())
    if refused:
        raise ValueError(refused[0])


def plan_text(plan: Plan, fmt: str, *, origin: str, extra: "dict | None" = None, pp: int = 1,
              vpp: "int | None" = None, backend: str = "te", sm: int = 100, fp8_recipe: "str | None" = None,
              fp4_recipe: str = "nvfp4", pattern: "str | None" = None) -> str:
    """`plan` as the text of `fmt`: the JSON plan with `extra` fields beside it, or a YAML headed by
    a comment that opens with `origin` (where the plan comes from); ValueError where the layout, the
    model (`pattern`: a HybridModel's layer pattern) or the GPU cannot take it (path_precisions,
    precision_configs)."""
    import yaml

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is unknown; valid: {', '.join(FORMATS)}")
    if fmt == "json":
        return json.dumps({**plan.to_dict(), **(extra or {})}, indent=1)
    _check_supported(pattern, backend)
    paths = path_precisions(plan, pp=pp, vpp=vpp, pattern=pattern)
    try:
        configs = precision_configs(set(paths.values()), backend=backend, sm=sm, fp8_recipe=fp8_recipe,
                                    fp4_recipe=fp4_recipe)
    except ValueError as e:
        fix = ("a HybridModel's linears are TE's: plan only what this GPU runs" if pattern is not None
               else "or export with --backend emulated for SNIP's emulated linears")
        raise ValueError(f"{e}\n({fix})") from None
    doc = (megatron_config if fmt == "megatron" else bridge_config)(paths, configs)
    layout = (f"HybridModel {pattern!r}, " if pattern else "") + f"PP={pp}" + (f" VPP={vpp}" if vpp else "")
    return (f"# {origin}, digest {plan.digest()[:12]}: {plan.counts()}; module paths for {layout}, "
            f"{backend} configs" + (f" for SM{sm}" if backend == "te" else "") + "\n"
            + yaml.safe_dump(doc, sort_keys=False))


def export(run_dir: "str | Path", fmt: str, *, step: "int | None" = None, out: "str | Path | None" = None,
           pp: int = 1, vpp: "int | None" = None, backend: str = "te", sm: int = 100,
           fp8_recipe: "str | None" = None, fp4_recipe: str = "nvfp4", pattern: "str | None" = None) -> Path:
    """Write the run's plan (final, or in force at `step`) in `fmt`; returns the file written."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is unknown; valid: {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    applied, plan = plan_at(run_dir, step)
    target = Path(out) if out is not None else run_dir / DEFAULT_NAMES[fmt]
    text = plan_text(plan, fmt, origin=f"SNIP plan of {run_dir} applied at step {applied}",
                     extra={"step": applied, "source": str(run_dir / "snip_plans.jsonl")}, pp=pp, vpp=vpp,
                     backend=backend, sm=sm, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe, pattern=pattern)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run_dir", help="the run folder (holds snip_plans.jsonl)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="megatron: --te-precision-config-file YAML; bridge: a model.quant_recipe "
                             "config override; json: the plan (snip.plan / --snip-plan)")
    parser.add_argument("--step", type=int, default=None, help="the plan in force at this step (default: final)")
    parser.add_argument("--out", default=None, help=f"output file (default: RUN_DIR/{DEFAULT_NAMES['megatron']}, ...)")
    parser.add_argument("--hybrid-layer-pattern", default=None, metavar="PATTERN",
                        help="a HybridModel's plan: the run's layer pattern (each layer's kind, its '|' stages)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages the module paths are for (default 1)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    parser.add_argument("--backend", default="te", choices=("te", "emulated"),
                        help="configs for Transformer Engine linears (default) or SNIP's emulated linears")
    parser.add_argument("--sm", type=int, default=100, help="GPU compute capability for --backend te (default 100)")
    parser.add_argument("--fp8-recipe", default=None, help="FP8 recipe (default: SnipConfig's, blockwise)")
    parser.add_argument("--fp4-recipe", default="nvfp4", help="FP4 recipe (default nvfp4)")
    return parser


def main(argv=None) -> None:
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m snip_megatron.report export",
        description="Write a run's SNIP plan as a static per-module precision config."))
    args = parser.parse_args(argv)
    try:
        path = export(args.run_dir, args.format, step=args.step, out=args.out, pp=args.pp, vpp=args.vpp,
                      backend=args.backend, sm=args.sm, fp8_recipe=args.fp8_recipe, fp4_recipe=args.fp4_recipe,
                      pattern=args.hybrid_layer_pattern)
    except ValueError as e:
        parser.error(str(e))
    print(f"{args.format}: {path}")
