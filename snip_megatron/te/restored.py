"""A resume's Transformer Engine extra state: recipes a checkpoint restored into TE's modules.

TE 2.14-2.16.0 and 2.17.0 restore the recipe pickled in each module's `_extra_state` and build the
module's quantizers from it (`set_extra_state` -> `init_fp8_meta_tensors`, v2.14
pytorch/module/base.py:915-948); at the next forward `set_meta_tensor` returns early while the
recipe class matches (base.py:747-763), so the module keeps quantizers made under the saving
process's environment: an NVFP4 linear saved with NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1 keeps
rounding its gradients to nearest after a resume without it, while SNIP measures the formats this
environment gives. TE's later releases (2.16.1, 2.17.1, >= 2.18; #3123, pytorch/_extra_state.py)
ignore a pickled stateless recipe (every built-in one but DelayedScaling): they carry no state a
step needs. SNIP does the same on the versions that still restore them: it clears TE's
`fp8_meta_tensors_initialized` on each such module, so the next quantized forward builds its
quantizers from that forward's recipe (TE's own way to force new quantizers, v2.18
base.py:928-929), and says at start-up which environment-read fields the checkpoint's recipes had
otherwise. Delayed scaling (stateful) is refused by SNIP; a CustomRecipe is left alone.

Duck-typed on TE's module attributes (`fp8_meta`, `fp8_initialized`, `fp8_meta_tensors_initialized`):
imports neither TE nor Megatron.
"""

from __future__ import annotations

STATELESS = ("Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling")
"""TE's recipes with no state a checkpoint needs (v2.18 pytorch/_extra_state.py `_RECIPE_POLICIES`)."""
ENV_FIELDS = {"Float8CurrentScaling": ("use_power_2_scales",), "Float8BlockScaling": ("use_f32_scales",),
              "NVFP4BlockScaling": ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
                                    "row_scaled_activation", "nvfp4_4over6", "nvfp4_4over6_e4m3_use_256",
                                    "nvfp4_4over6_err_mode")}
"""Each recipe's fields TE fills from its environment (snip_megatron.te.environment), besides
`backward_override` (every recipe, TE >= 2.15)."""


def holds_restored_recipe(module) -> bool:
    """`module` (a TE module) holds quantizers built from a checkpoint's stateless recipe and has not
    run a quantized forward since: `set_extra_state` put the recipe in fp8_meta and made quantizers,
    and no forward initialised it (`fp8_initialized` False)."""
    meta = getattr(module, "fp8_meta", None)
    recipe = meta.get("recipe") if isinstance(meta, dict) else None
    return (recipe is not None and type(recipe).__name__ in STATELESS
            and getattr(module, "fp8_meta_tensors_initialized", False) and not getattr(module, "fp8_initialized", False))


def environment_fields(recipe) -> list[tuple[str, object, object]]:
    """(field, the recipe's value, this process's default) of each field TE reads from its
    environment where `recipe` (a checkpoint's) differs from a recipe of its class made here."""
    try:
        here = type(recipe)()  # its defaults: this process's environment, read when TE was imported
    except Exception:  # an environment TE's recipe asserts against (SNIP refuses those at start-up)
        return []
    fields = ENV_FIELDS.get(type(recipe).__name__, ()) + ("backward_override",)
    return [(f, getattr(recipe, f), getattr(here, f)) for f in fields
            if hasattr(recipe, f) and hasattr(here, f) and getattr(recipe, f) != getattr(here, f)]


def requantize_restored(modules) -> list[str]:
    """Make every module of `modules` that holds a checkpoint's stateless recipe build new
    quantizers from its next forward's recipe; one line per recipe class whose environment-read
    fields differ from this process's (empty: nothing differed, or nothing was restored)."""
    differing: dict[str, list] = {}
    for module in modules:
        if not holds_restored_recipe(module):
            continue
        recipe = module.fp8_meta["recipe"]
        module.fp8_meta_tensors_initialized = False
        for field, theirs, ours in environment_fields(recipe):
            seen = differing.setdefault(type(recipe).__name__, [])
            if field not in [f for f, _, _ in seen]:
                seen.append((field, theirs, ours))
    return [f"{name} {', '.join(f'{f}={a!r} (this run: {b!r})' for f, a, b in fields)}"
            for name, fields in differing.items()]


def notice(differences: list[str]) -> "str | None":
    """The start-up line of a resume whose TE extra state was saved under another environment."""
    if not differences:
        return None
    return ("the checkpoint's Transformer Engine extra state holds recipes made under another TE environment ("
            + "; ".join(differences) + "): TE would keep their quantizers while the recipe class matches, so SNIP "
            "has each module build its quantizers from this run's recipe, the formats SNIP measures")
