"""Planner solve time at scale: the 70B layout (80 layers x 4 linears), a 126-layer 405B-like one, a
70B-class HybridModel (112 Mamba / MLP / attention layers in 8 '|' pipeline segments) and DeepSeek-V3
(61 layers of MLA, 58 of them MoE with 256 routed experts and a shared one, and an MoE MTP layer: 553
planned units) at its published layout, EP=64 and PP=16 with VPP=2 (Megatron's custom pipeline
layout, the MTP layer on the last stage), its stages from Megatron's own layout.

Synthetic but shaped costs (FP4 harm ~10x FP8 harm, edge layers more sensitive, lognormal spread);
real FLOP tables. Every case is solved by CBC (through solve_plan, model building and the CBC
subprocess included), by CBC on the plain model without the ordering rows between same-shape layers
(PlannerConfig.aggregate_layers=False, the model before them; once, side by side) and by the exact
fallback; the relative gap is CBC's objective over the exact one. cbc_s is the median wall time of
solve_plan (what the controller waits for), cbc_cpu the CBC processes' CPU time per solve; a status
other than "optimal", or "exact" as solver, means CBC did not prove its answer in its time limit.
Run: python bench/planner_scale.py [--repeats 3] [--no-plain]. Last line:
RESULT solve_s_70b=<max over the 70B cases> solve_s_405b=<max over the 405B cases>
solve_s_hybrid70b=<max over the hybrid cases, inventory built from the pattern included>
solve_s_dsv3=<max over the DeepSeek-V3 cases, inventory enumerated included>
max_rel_gap=<x, over the cases whose exact fallback proved its answer> max_solve_s=<max over all cases> all_optimal=<1 if CBC proved every case>
plain_max_s=<the plain model's max> (targets: solve_s_70b < 1.0, solve_s_hybrid70b < 1.0,
solve_s_dsv3 < 1.0, max_solve_s < 2.0, all_optimal=1, max_rel_gap=0).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time
from dataclasses import replace

import numpy as np

from snip_megatron.formats.precision import Precision
from snip_megatron.models import hybrid
from snip_megatron.models.inventory import Inventory
from snip_megatron.models.published import DEEPSEEK_V3
from snip_megatron.planner import (PlannerConfig, cbc_available, flop_table, solve_plan,
                                   stage_of_layers, stages_for_keys)
from snip_megatron.shapes import ModelShape, get_shape

LLAMA_405B = ModelShape(name="llama_405b", num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                        num_attention_heads=128, num_query_groups=8, vocab_size=128256,
                        seq_length=8192)
# A Nemotron-H-like 70B-class HybridModel: per pipeline segment 6 Mamba, 6 MLP (squared ReLU, not
# gated) and 2 attention layers; hidden 8192; about 68B parameters in its planned linears.
HYBRID_70B_PATTERN = "|".join(["M-M-M*-M-M-M*-"] * 8)
HYBRID_70B = ModelShape(name="hybrid_70b", num_layers=112, hidden_size=8192, ffn_hidden_size=57344,
                        num_attention_heads=64, num_query_groups=8, gated_linear_unit=False,
                        vocab_size=131072, seq_length=8192)
HYBRID_70B_DIMS = hybrid.HybridDims()
TWO = (Precision.FP8, Precision.FP4)
THREE = (Precision.BF16, Precision.FP8, Precision.FP4)


def synthetic_costs(model: "ModelShape | Inventory", seed: int = 0) -> dict:
    """Q_l(p): FP4 lognormal around 1, edge layers up to 4x, FP8 2-10% of FP4, BF16 0, over a
    model's inventory (or a dense GPT's shape)."""
    rng = np.random.default_rng(seed)
    costs = {}
    keys = list(model.keys()) if isinstance(model, Inventory) else list(flop_table(model, tokens=1))
    num_layers = max(k.layer for k in keys)
    for key in keys:
        edge = min(key.layer - 1, num_layers - key.layer)
        fp4 = float(rng.lognormal(0.0, 0.7) * (1.0 + 3.0 * math.exp(-edge / 2.0)))
        costs[key] = {Precision.BF16: 0.0, Precision.FP8: fp4 * float(rng.uniform(0.02, 0.1)),
                      Precision.FP4: fp4}
    return costs


DSV3_PP, DSV3_VPP = 16, 2
DSV3_LAYOUT = [["embedding", "decoder"]] + [["decoder", "decoder"]] * 30 + [["mtp", "loss"]]
"""DeepSeek-V3's 61 layers in PP x VPP = 32 chunks, in the model's order (Megatron-Bridge's DeepSeek
recipes give `pipeline_model_parallel_layout` such lists): the embedding and a layer, 2 layers each,
the MTP layer and the loss last."""


def deepseek_v3_stages() -> dict:
    """Each DeepSeek-V3 unit's pipeline stage at PP=16 x VPP=2 (EP=64, TP=2 with SP), by Megatron's
    own layout (snip_megatron.megatron.layout.pipeline_stages on its TransformerConfig)."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from snip_megatron.megatron.layout import pipeline_stages

    d = DEEPSEEK_V3
    config = MLATransformerConfig(
        num_layers=d.shape.num_layers, hidden_size=d.shape.hidden_size, ffn_hidden_size=d.shape.ffn_hidden_size,
        num_attention_heads=d.shape.num_attention_heads, add_bias_linear=False, **vars(d.mla),
        **d.moe.config_fields(), mtp_num_layers=d.mtp_num_layers, tensor_model_parallel_size=2, sequence_parallel=True,
        expert_model_parallel_size=64, expert_tensor_parallel_size=1, pipeline_model_parallel_size=DSV3_PP,
        virtual_pipeline_model_parallel_size=DSV3_VPP, pipeline_model_parallel_layout=DSV3_LAYOUT,
        pipeline_dtype=torch.bfloat16, bf16=True)
    return pipeline_stages(config)


def cases(seed: int):
    """(group, label, model: a GPT shape or an Inventory, costs, config, pipeline stages or None)."""
    inventory = hybrid.inventory(HYBRID_70B, HYBRID_70B_PATTERN, HYBRID_70B_DIMS)
    dsv3 = DEEPSEEK_V3.inventory(sequence_parallel=True)
    for model, group, pp in ((get_shape("llama_70b"), "70b", 8), (LLAMA_405B, "405b", 9),
                             (inventory, "hybrid70b", 8), (dsv3, "dsv3", DSV3_PP)):
        shape = {id(inventory): HYBRID_70B, id(dsv3): DEEPSEEK_V3.shape}.get(id(model), model)
        costs = synthetic_costs(model, seed)
        if model is dsv3:
            stages = deepseek_v3_stages()
        else:
            layer_stage = (hybrid.stage_of_layers(HYBRID_70B_PATTERN, pp) if model is inventory
                           else stage_of_layers(shape.num_layers, pp))
            stages = stages_for_keys(costs, layer_stage)
        for allowed in (TWO, THREE):
            for rho in (0.5, 0.75, 0.9):
                for staged in (False, True):
                    label = f"{shape.name} {len(allowed)}p rho={rho}" + (f" pp={pp}" if staged else "")
                    yield group, label, model, costs, PlannerConfig(rho=rho, allowed=allowed), \
                        stages if staged else None
        label = f"{shape.name} 3p speedup=3.0 pp={pp}"
        yield group, label, model, costs, PlannerConfig(budget="speedup", speedup=3.0, allowed=THREE), stages


def model_flops(model: "ModelShape | Inventory") -> dict:
    """The FLOP table of one sequence: an inventory is enumerated here (a hybrid's from its pattern,
    DeepSeek-V3's from its widths), so its time counts with the solve's."""
    if isinstance(model, Inventory) and model.family == hybrid.FAMILY:
        return hybrid.inventory(HYBRID_70B, HYBRID_70B_PATTERN, HYBRID_70B_DIMS).flop_table(HYBRID_70B.seq_length)
    if isinstance(model, Inventory):
        return DEEPSEEK_V3.inventory(sequence_parallel=True).flop_table(DEEPSEEK_V3.shape.seq_length)
    return flop_table(model)


def _child_cpu() -> float:
    """CPU seconds of finished child processes (the CBC runs): insensitive to a busy machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="CBC solves per case (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=10.0, help="CBC time limit, seconds")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain model (one binary per layer and choice)")
    args = parser.parse_args()
    if not cbc_available():
        raise SystemExit("CBC is not available (PuLP >= 4: pip install 'pulp[cbc]'); nothing to time")

    # Warm up once: the first solve pays PuLP's import.
    warm = get_shape("llama_tiny")
    solve_plan(synthetic_costs(warm, 0), flop_table(warm), PlannerConfig())

    worst = {"70b": 0.0, "405b": 0.0, "hybrid70b": 0.0, "dsv3": 0.0}
    worst_cpu = {"70b": 0.0, "405b": 0.0, "hybrid70b": 0.0, "dsv3": 0.0}  # model building + CBC, CPU s per solve
    max_gap, plain_max, all_optimal = 0.0, 0.0, True
    print(f"{'case':38s} {'solver':6s} {'status':8s} {'cbc_s':>7s} {'cbc_cpu':>7s} {'plain_s':>7s} "
          f"{'plain':8s} {'exact_s':>8s} {'objective':>12s} {'rel_gap':>9s} {'fp4':>6s} "
          f"{'min_stage_fp4':>13s} {'speedup':>7s}")
    for group, label, model, costs, config, stages in cases(args.seed):
        flops = model_flops(model)
        config = replace(config, time_limit_s=args.time_limit)
        child_cpu, own_cpu = _child_cpu(), time.process_time()
        runs, enumerate_s = [], 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            flops = model_flops(model)  # the hybrid's inventory, from its pattern, every time
            enumerate_s = max(enumerate_s, time.perf_counter() - start)
            runs.append(solve_plan(costs, flops, config, stages=stages))
        cbc_cpu = (_child_cpu() - child_cpu) / args.repeats
        total_cpu = cbc_cpu + (time.process_time() - own_cpu) / args.repeats
        worst_cpu[group] = max(worst_cpu[group], total_cpu)
        ilp = runs[-1]
        exact = solve_plan(costs, flops, replace(config, solver="exact"), stages=stages)
        seconds = statistics.median(r.seconds for r in runs) + enumerate_s
        gap = (ilp.objective - exact.objective) / max(abs(exact.objective), 1e-12)
        worst[group] = max(worst[group], seconds)
        if exact.status == "optimal":  # DeepSeek-V3's FLOP units overflow the exact DP: it is "feasible" only
            max_gap = max(max_gap, abs(gap))
        all_optimal &= all(r.solver == "cbc" and r.status == "optimal" for r in runs)
        plain_s, plain_status = float("nan"), "-"
        if not args.no_plain:
            plain = solve_plan(costs, flops, replace(config, aggregate_layers=False), stages=stages)
            plain_s = plain.seconds
            plain_status = plain.status if plain.solver == "cbc" else "fallback"
            plain_max = max(plain_max, plain_s)
        stage_fp4 = min((a.fp4_fraction for a in ilp.per_stage.values()), default=float("nan"))
        print(f"{label:38s} {ilp.solver:6s} {ilp.status:8s} {seconds:7.3f} {cbc_cpu:7.3f} {plain_s:7.3f} "
              f"{plain_status:8s} {exact.seconds:8.3f} {ilp.objective:12.6f} {gap:9.2e} "
              f"{ilp.achieved.fp4_fraction:6.3f} {stage_fp4:13.3f} {ilp.achieved.speedup:7.3f}"
              + (f"  [{ilp.fallback_reason}]" if ilp.fallback_reason else ""))
    print(f"CPU solve_cpu_s_70b={worst_cpu['70b']:.3f} solve_cpu_s_405b={worst_cpu['405b']:.3f} "
          f"solve_cpu_s_hybrid70b={worst_cpu['hybrid70b']:.3f} solve_cpu_s_dsv3={worst_cpu['dsv3']:.3f} "
          f"(wall/CPU differ when the machine is shared; load average {os.getloadavg()[0]:.1f})")
    plain = "" if args.no_plain else f" plain_max_s={plain_max:.3f}"
    print(f"RESULT solve_s_70b={worst['70b']:.3f} solve_s_405b={worst['405b']:.3f} "
          f"solve_s_hybrid70b={worst['hybrid70b']:.3f} solve_s_dsv3={worst['dsv3']:.3f} max_rel_gap={max_gap:.2e} "
          f"max_solve_s={max(worst.values()):.3f} all_optimal={int(all_optimal)}{plain}")

if __name__ == "__main__":
    main()
