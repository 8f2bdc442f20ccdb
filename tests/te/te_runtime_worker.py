"""TE run-time state SNIP manages, through Megatron's real TE wrappers over the TE double (one process,
TP=PP=1): the weight-cache re-arm found by behaviour, and a resume under another TE environment.

    PYTHONPATH=<repo>:[<te version folder>:]<repo>/tests/te_double python tests/te/te_runtime_worker.py \
        PHASE --ckpt FILE --out FILE

PHASE:
  cache         the re-arm probe on this megatron-core and against a stand-in of
                `MegatronModule.set_is_first_microbatch` without Megatron-LM's fix (5389d147): SNIP's
                start-up line, and apply_plan's weight cache on every TE linear of the model (a
                planned GPT plus a TE linear quantized by a user's config SNIP does not plan);
  save          train the planned TE GPT one step under this process's environment and save its
                state dict (TE's `_extra_state` holds each quantized module's recipe);
  resume        load that state dict into a new model twice: once trained as Megatron alone would
                (what TE's quantizers then carry), once after SNIP's apply_plan (what they carry
                then, and SNIP's start-up line).
tests/te/test_te_runtime.py runs the phases and asserts on the JSON they write.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.te import te_worker as worker  # noqa: E402


def pre_fix_set_is_first_microbatch(self):
    """Megatron-LM's `MegatronModule.set_is_first_microbatch` before 5389d147 (#5642): as in
    megatron-core 0.16.1-0.18.x and main's builds of 2026-06-03 to 2026-07-11 (which report 0.19.0):
    the flag is re-armed only under a global fp8/fp4 or kitchen, never for a quant_recipe."""
    if self.config.fp8 is not None or self.config.fp4 is not None or getattr(self.config, "use_kitchen", False):
        if not hasattr(self, "modules_with_is_first_microbatch"):
            self.modules_with_is_first_microbatch = [m for m in self.modules() if hasattr(m, "is_first_microbatch")]
        for m in self.modules_with_is_first_microbatch:
            m.is_first_microbatch = True


def user_te_linear(config):
    """A TE linear SNIP does not plan, quantized by a user's precision config (FP8 blockwise), as
    Megatron builds one from --te-precision-config-file (finish_init with the matched config)."""
    from megatron.core.extensions.transformer_engine import TELinear
    from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig

    from snip_megatron.megatron.quant_recipe import config_dict_for

    linear = TELinear(64, 64, parallel_mode="duplicated", config=config, init_method=torch.nn.init.xavier_normal_,
                      bias=False, skip_bias_add=False, skip_weight_param_allocation=False)
    linear.finish_init(QuantizationConfig(config_dict_for("te", sm=100, formats=worker.formats_on(100))["fp8"],
                                          MatchContext("user_proj", None), "user_fp8"))
    return linear


def cache_state(model) -> dict:
    from snip_megatron.megatron.apply import te_cached_modules

    cached = te_cached_modules(model)
    return {name: bool(m.disable_parameter_transpose_cache) for name, m in model.named_modules()
            if any(m is c for c in cached)}


def phase_cache() -> dict:
    from megatron.core.transformer.module import MegatronModule

    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import apply_plan, megatron_rearms_te_cache, weight_cache_notice

    out = {}
    original = MegatronModule.set_is_first_microbatch
    for name, method in (("installed", original), ("stand_in", pre_fix_set_is_first_microbatch)):
        MegatronModule.set_is_first_microbatch = method
        try:
            runtime.seed_all(worker.SEED)
            model = worker.build_te_gpt(the_plan=worker.plan())
            model.user_proj = user_te_linear(model.config)
            apply_plan(model, worker.plan(), sm=100, formats=worker.formats_on(100))
            flags = cache_state(model)
            # the user's linear over two steps of Megatron's schedule (which re-arms at each step's
            # first micro-batch), its weight changed by the step between them
            x = torch.randn(32, 64, dtype=model.user_proj.weight.dtype)
            runs = []
            for _ in range(2):
                model.set_is_first_microbatch()
                model.user_proj(x)
                runs.append(model.user_proj.last_run.weight_workspace)
                with torch.no_grad():
                    model.user_proj.weight.add_(0.01)
            out[name] = {"probe": megatron_rearms_te_cache(), "probe_model": megatron_rearms_te_cache(model.config),
                         "notice": weight_cache_notice(), "cache_off": flags, "user_runs": runs}
        finally:
            MegatronModule.set_is_first_microbatch = original
    return out


def _fp4_linears(model) -> dict:
    return {k: m for k, m in worker.planned_linears(model).items() if worker.PLAN_TABLE[tuple(
        (int(k.split(".")[0]), k.split(".")[1]))] == "fp4"}


def phase_save(ckpt: str) -> dict:
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import apply_plan

    runtime.seed_all(worker.SEED)
    model = worker.build_te_gpt(the_plan=worker.plan())
    apply_plan(model, worker.plan(), sm=100, formats=worker.formats_on(100))
    worker.train(model, steps=1)
    torch.save(model.state_dict(), ckpt)
    return {"saved_rounding": {k: m.last_run.quantizer_recipe.disable_stochastic_rounding
                               for k, m in _fp4_linears(model).items()}}


def _resumed(ckpt: str):
    from snip_megatron.megatron import runtime

    runtime.seed_all(worker.SEED)
    model = worker.build_te_gpt(the_plan=worker.plan())
    model.load_state_dict(torch.load(ckpt, weights_only=False))
    return model


def _quantizers(model) -> dict:
    """Per FP4 linear after a step: whether its quantizers round gradients to nearest, and the
    quantizers its GEMMs ran (the double's `LinearQuantizers.short_str()`: " sr" marks stochastic
    gradient rounding)."""
    return {k: [m.last_run.quantizer_recipe.disable_stochastic_rounding, m.last_run.spec.short_str()]
            for k, m in _fp4_linears(model).items()}


def phase_resume(ckpt: str) -> dict:
    from snip_megatron.megatron.apply import apply_plan

    out = {"this_run": worker.formats_on(100).fp4_gradient_rounding}
    model = _resumed(ckpt)  # Megatron alone: TE's restored state as it is
    out["restored"] = {k: m.fp8_meta.get("recipe") is not None for k, m in _fp4_linears(model).items()}
    worker.train(model, steps=1)
    out["megatron_alone"] = _quantizers(model)
    model = _resumed(ckpt)  # as every SNIP loop starts: apply_plan after the checkpoint is loaded
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        apply_plan(model, worker.plan(), sm=100, formats=worker.formats_on(100))
    out["said"] = [line for line in said.getvalue().splitlines() if line.startswith("[snip]")]
    worker.train(model, steps=1)
    out["with_snip"] = _quantizers(model)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("cache", "save", "resume"))
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker.require_double()
    torch.set_num_threads(1)
    from snip_megatron.megatron import runtime

    runtime.initialize_model_parallel(tp=1, pp=1, seed=worker.SEED)
    result = {"cache": phase_cache, "save": lambda: phase_save(args.ckpt),
              "resume": lambda: phase_resume(args.ckpt)}[args.phase]()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
