"""AdamW statistics of the planned linears' weights, read from Megatron's optimizer.

Handles torch Adam/AdamW, Megatron's FP32Optimizer, Float16OptimizerWithFloat16Params,
DistributedOptimizer (each data-parallel rank holds a shard of the state: the caller sums over
DP, see reduce.py) and ChainedOptimizer.
"""

from __future__ import annotations

import torch


def _pairs(optimizer):
    """Yield (model_param, main_param, torch_optimizer) for every parameter with optimizer state."""
    if hasattr(optimizer, "chained_optimizers"):
        for sub in optimizer.chained_optimizers:
            yield from _pairs(sub)
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    if hasattr(optimizer, "shard_fp32_groups"):  # DistributedOptimizer
        groups = [(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
                  (optimizer.model_fp32_groups, optimizer.shard_fp32_groups)]
    elif hasattr(optimizer, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = [(optimizer.float16_groups, optimizer.fp32_from_float16_groups),
                  (optimizer.fp32_from_fp32_groups, optimizer.fp32_from_fp32_groups)]
    else:  # FP32Optimizer or a plain torch optimizer: the model params are the main params
        groups = [([g["params"] for g in inner.param_groups],) * 2]
    for model_groups, main_groups in groups:
        for model_group, main_group in zip(model_groups, main_groups):
            for model_param, main_param in zip(model_group, main_group):
                yield model_param, main_param, inner


def is_dp_sharded(optimizer) -> bool:
    """True when data-parallel ranks hold disjoint shards of the state (distributed optimizer)."""
    if hasattr(optimizer, "chained_optimizers"):
        return any(is_dp_sharded(o) for o in optimizer.chained_optimizers)
    return hasattr(optimizer, "shard_fp32_groups")


def _group_of(inner, param):
    for g in inner.param_groups:
        if any(p is param for p in g["params"]):
            return g
    return inner.param_groups[0]


@torch.no_grad()
def adam_statistics(optimizer, weights: dict) -> dict:
    """{key: {field: value}} (table.ADAM fields) for this rank's share of each weight.

    adam_du_sq = sum (c / (sqrt(v_hat) + eps))^2 with c = (1 - b1) / (1 - b1^t): how much the
    update moves per unit change of the gradient (lr left out); adam_upd_sq = sum of the squared
    BF16 update m_hat / (sqrt(v_hat) + eps) (lr left out); adam_dv_sq and adam_v_sum weight the
    first by v_hat (errors distributed like the gradient). Zeros where there is no state yet."""
    by_id = {id(w): k for k, w in weights.items()}
    names = ("adam_du_sq", "adam_dv_sq", "adam_v_sum", "adam_upd_sq", "adam_numel")
    out = {k: dict.fromkeys(names, 0.0) for k in weights}
    if optimizer is None:
        return out
    for model_param, main_param, inner in _pairs(optimizer):
        key = by_id.get(id(model_param))
        if key is None:
            continue
        state = inner.state.get(main_param, {})
        if "exp_avg_sq" not in state or main_param.numel() == 0:
            continue
        group = _group_of(inner, main_param)
        b1, b2 = group["betas"]
        eps = group["eps"]
        step = float(state["step"]) if "step" in state else 1.0
        m = state["exp_avg"].double()
        v = state["exp_avg_sq"].double()
        v_hat = v / (1 - b2 ** step)
        denom = v_hat.sqrt() + eps
        c = (1 - b1) / (1 - b1 ** step)
        scale = (c / denom) ** 2
        acc = out[key]
        acc["adam_du_sq"] += float(scale.sum())
        acc["adam_dv_sq"] += float((v_hat * scale).sum())
        acc["adam_v_sum"] += float(v_hat.sum())
        acc["adam_upd_sq"] += float(((m / (1 - b1 ** step) / denom) ** 2).sum())
        acc["adam_numel"] += float(v.numel())
    return out
