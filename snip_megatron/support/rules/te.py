"""Rules on Transformer Engine's environment switches: a switch the installed TE reads that changes
what a recipe of the run computes, set away from TE's default, and that SNIP does not follow
(snip_megatron.te.environment, with each switch's TE file:line per version). Checked once the
run's formats are resolved for the GPU (a Hopper run plans no FP4, so NVFP4's switches do not
matter there); a switch this TE does not read yet is said at start-up instead (`unread_notices`).
"""

from __future__ import annotations

from snip_megatron.support.rule import Rule
from snip_megatron.te import environment as env

TE_RUN = {"run.backend": "te", "model.transformer_impl": "transformer_engine", "run.te_installed": True}
"""A run on Transformer Engine's linears (an example adds the TE version and its environment)."""


def _found(*names: str):
    """The condition of a rule on `names`: the first of them the run's TE reads and SNIP refuses,
    with its message values."""

    def when(s):
        if s.run.backend != "te" or s.snip is None:
            return None
        uses = set(s.snip.uses_names)
        refused = env.refused(s.run.te_environ, s.run.te_version, fp8="fp8" in uses,
                              nvfp4="fp4" in uses and s.snip.fp4_recipe == "nvfp4")
        name = next((n for n in names if n in refused), None)
        if name is None:
            return None
        return {"name": name, "version": s.run.te_version, **refused[name]}

    return when


SAYS = ("{x[name]}={x[value]!r}: Transformer Engine {x[version]} (which reads it from {x[since]}) then runs "
        "{x[effect]}, not what SNIP measures")
FIX = "unset {x[name]} where the run starts"
FIX_FP4 = FIX + " (or plan without FP4: {set[snip.precisions]:bf16,fp8})"

RULES = (
    Rule("te-backward-override", ("run.te_environ",), _found(env.BACKWARD_OVERRIDE), SAYS, FIX,
         example={**TE_RUN, "run.te_version": "2.18.0",
                  "run.te_environ": ((env.BACKWARD_OVERRIDE, "high_precision"),)},
         entries=("megatron-lm", "bridge"), after_resolve=True),
    Rule("te-nvfp4-row-scaled", ("run.te_environ",), _found(env.NVFP4_ROW_SCALED), SAYS, FIX_FP4,
         example={**TE_RUN, "run.te_version": "2.16.0", "snip.precisions": ("fp8", "fp4"),
                  "run.te_environ": ((env.NVFP4_ROW_SCALED, "1"),)},
         entries=("megatron-lm", "bridge"), after_resolve=True),
    Rule("te-nvfp4-4over6", ("run.te_environ",),
         _found(env.NVFP4_4OVER6, env.NVFP4_4OVER6_E4M3_256, env.NVFP4_4OVER6_ERR_MODE, env.NVFP4_4OVER6_FAST_MATH),
         SAYS, FIX_FP4,
         example={**TE_RUN, "run.te_version": "2.18.0", "snip.precisions": ("fp8", "fp4"),
                  "run.te_environ": ((env.NVFP4_4OVER6, "weights"),)},
         entries=("megatron-lm", "bridge"), after_resolve=True),
    Rule("te-nvfp4-fast-math", ("run.te_environ",), _found(env.FAST_MATH), SAYS, FIX_FP4,
         example={**TE_RUN, "run.te_version": "2.14.0", "snip.precisions": ("fp8", "fp4"),
                  "run.te_environ": ((env.FAST_MATH, "1"),)},
         entries=("megatron-lm", "bridge"), after_resolve=True),
)
