"""snip-layout: every rank's planned linears for a model layout, checked without building the model.

    python -m snip_megatron.cli.layout --model llama_70b --tp 8 --pp 8 [--vpp N]
    python -m snip_megatron.cli.layout --recipe [model=llama_70b parallel=tp8_pp8_vpp2]

Checks that every LayerKey is owned by exactly one pipeline chunk and by all TP ranks of it, and
that a random plan round-trips through each rank's matcher (Megatron's `get_quant_config_or_none`);
the layout itself is `snip_megatron.megatron.layout`'s. Last line:
`RESULT layers=<n_linears> ranks=<n> seconds=<t> ok=1`.
"""

from __future__ import annotations

import argparse
import sys
import time

from snip_megatron.megatron.layout import (check_ownership, describe, enumerate_layout, random_plan,
                                           roundtrip_plan)
from snip_megatron.shapes import ModelShape, get_shape


def _split_from_args(args) -> tuple[ModelShape, int, int, "int | None", int]:
    """(shape, tp, pp, vpp, dp) from the flags, or from a composed Hydra recipe with --recipe."""
    if args.recipe is None:
        return (get_shape(args.model or "llama_tiny"), args.tp or 1, args.pp or 1, args.vpp,
                args.dp or 1)
    given = [f"--{n}" for n in ("model", "tp", "pp", "vpp", "dp") if getattr(args, n) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} cannot be combined with --recipe: the recipe sets them "
                         f"(override them there, e.g. parallel.tp=2)")
    from snip_megatron.cli.recipe import compose_recipe

    recipe = compose_recipe(args.recipe)  # no overrides: the tiny recipe
    par = recipe.parallel
    return recipe.model.shape(), par.tp, par.pp, par.vpp, par.data_parallel_size


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="preset name (snip_megatron.shapes); default llama_tiny")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    ap.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default 1)")
    ap.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (ranks = tp*pp*dp)")
    ap.add_argument("--recipe", nargs="*", default=None, metavar="OVERRIDE",
                    help="take model and split from a Hydra recipe (configs/), e.g. --recipe "
                         "model=llama_70b parallel=tp8_pp8; no overrides: the tiny recipe")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random plan round-tripped")
    ap.add_argument("--verbose", action="store_true", help="print every module of every rank")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    shape, tp, pp, vpp, dp = _split_from_args(args)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    ranks = enumerate_layout(shape, tp=tp, pp=pp, vpp=vpp, dp=dp)
    check_ownership(shape, ranks, tp)
    plan = random_plan(shape.num_layers, args.seed)
    back = roundtrip_plan(plan, ranks)
    if back != plan:
        raise ValueError(f"plan did not round-trip through the matchers: {plan.diff(back)[:4]}")
    seconds = time.perf_counter() - t0

    print(f"model {shape.name}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
          f"ffn {shape.ffn_hidden_size}, heads {shape.num_attention_heads}, "
          f"query groups {shape.num_query_groups}; tp={tp} pp={pp} vpp={vpp} dp={dp}")
    for r in ranks:
        print(describe(r, args.verbose))
    print(f"plan digest {plan.digest()[:16]} round-tripped on every rank; each of "
          f"{len(plan)} linears owned by one pipeline chunk and all {tp} TP ranks of it")
    print(f"RESULT layers={len(plan)} ranks={len(ranks)} seconds={seconds:.2f} ok=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
