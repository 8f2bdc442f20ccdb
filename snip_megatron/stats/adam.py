"""AdamW statistics of the planned linears' weights, read from Megatron's optimizer.

Handles torch Adam/AdamW, Megatron's FP32Optimizer, Float16OptimizerWithFloat16Params,
DistributedOptimizer (each data-parallel rank holds a shard of the state: the caller sums over
DP, see reduce.py) and ChainedOptimizer; and the state as Transformer Engine's FusedAdam keeps it:
the step count in the param group (`group["step"]`, an int or a tensor) instead of each
parameter's state, and, with Megatron's `--use-precision-aware-optimizer`, moments stored as
BF16, FP16 with a per-tensor scale, or FP8 (a Float8Tensor), on the model's BF16 shard (the
optimizer holds the master weights). Scaled FP16 and FP8 moments are dequantized through
FusedAdam's own `get_unscaled_state` before use; FP32 and BF16 ones are read as stored.

Everything stays on the device: the sums go into the caller's accumulator as 0-dim tensors and
the step count enters the bias corrections as a tensor, so reading the statistics never waits
for the GPU. Moments are processed in blocks of BLOCK elements in float64 (a few blocks of
temporaries, not several float64 copies of a 60M-element shard).
"""

from __future__ import annotations

import torch

BLOCK = 1 << 22
NAMES = ("adam_du_sq", "adam_dv_sq", "adam_v_sum", "adam_upd_sq", "adam_numel")


def _pairs(optimizer):
    """Yield (model_param, param the optimizer holds state for, torch_optimizer)."""
    if hasattr(optimizer, "chained_optimizers"):
        for sub in optimizer.chained_optimizers:
            yield from _pairs(sub)
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    if hasattr(optimizer, "shard_fp32_groups"):  # DistributedOptimizer
        # with the precision-aware optimizer there is no FP32 main shard (None): the optimizer's
        # state is keyed by the model's own BF16 shard
        main16 = [[main if main is not None else shard for main, shard in zip(mains, shards)]
                  for mains, shards in zip(optimizer.shard_fp32_from_float16_groups,
                                           getattr(optimizer, "shard_float16_groups",
                                                   optimizer.shard_fp32_from_float16_groups))]
        groups = [(optimizer.model_float16_groups, main16),
                  (optimizer.model_fp32_groups, optimizer.shard_fp32_groups)]
    elif hasattr(optimizer, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = [(optimizer.float16_groups, optimizer.fp32_from_float16_groups),
                  (optimizer.fp32_from_fp32_groups, optimizer.fp32_from_fp32_groups)]
    else:  # FP32Optimizer or a plain torch optimizer: the model params are the main params
        groups = [([g["params"] for g in inner.param_groups],) * 2]
    for model_groups, main_groups in groups:
        for model_group, main_group in zip(model_groups, main_groups):
            for model_param, main_param in zip(model_group, main_group):
                if main_param is not None:
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


def _step(state: dict, group: dict):
    """The step count (a number or a tensor; FusedAdam keeps it in the param group), or None when
    the optimizer has not stepped."""
    return state["step"] if "step" in state else group.get("step")


def moment(inner, param, state: dict, name: str) -> torch.Tensor:
    """A moment as real numbers: FusedAdam's scaled FP16 and FP8 moments dequantized (a float32
    copy); FP32 and BF16 ones are read as stored (and converted a block at a time)."""
    stored = state[name]
    plain = type(stored) in (torch.Tensor, torch.nn.Parameter) and stored.dtype in (torch.float32, torch.bfloat16,
                                                                                     torch.float64)
    if not plain and hasattr(inner, "get_unscaled_state"):
        return inner.get_unscaled_state(param, name)
    return stored


@torch.no_grad()
def adam_statistics(optimizer, weights, add=None) -> dict:
    """{key: {field: 0-dim tensor}} (table.ADAM fields) for this rank's share of each weight.

    adam_du_sq = sum (c / (sqrt(v_hat) + eps))^2 with c = (1 - b1) / (1 - b1^t): how much the
    update moves per unit change of the gradient (lr left out); adam_upd_sq = sum of the squared
    BF16 update m_hat / (sqrt(v_hat) + eps) (lr left out); adam_dv_sq and adam_v_sum weight the
    first by v_hat (errors distributed like the gradient). Keys without state are left out.
    `add(key, field, value)`, when given, receives every value instead."""
    # a dict {key: weight}, or (key, weight) pairs: an MoE expert unit's weights add into one key
    by_id = {id(w): k for k, w in (weights.items() if isinstance(weights, dict) else weights)}
    out: dict = {}
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
        step = _step(state, group)
        if step is None:
            continue
        b1, b2 = group["betas"]
        eps = group["eps"]
        m, v = moment(inner, main_param, state, "exp_avg"), moment(inner, main_param, state, "exp_avg_sq")
        # a tensor step stays where it is (torch keeps it on the CPU, a capturable FusedAdam on the
        # GPU): 0-dim CPU tensors enter GPU ops as scalars without a device sync
        t = step.double() if isinstance(step, torch.Tensor) else torch.tensor(float(step), dtype=torch.float64)
        t = t.reshape(())
        bc1, bc2 = 1 - torch.pow(b1, t), 1 - torch.pow(b2, t)
        c = (1 - b1) / bc1
        sums = [torch.zeros((), dtype=torch.float64, device=v.device) for _ in range(4)]
        mf, vf = m.reshape(-1), v.reshape(-1)
        for s in range(0, vf.numel(), BLOCK):
            v_hat = vf[s:s + BLOCK].double() / bc2
            denom = v_hat.sqrt() + eps
            scale = (c / denom) ** 2
            sums[0] += scale.sum()
            sums[1] += (v_hat * scale).sum()
            sums[2] += v_hat.sum()
            sums[3] += ((mf[s:s + BLOCK].double() / bc1 / denom) ** 2).sum()
        values = dict(zip(NAMES, sums + [float(v.numel())]))
        acc = out.setdefault(key, {})
        for f, val in values.items():
            acc[f] = acc[f] + val if f in acc else val
            if add is not None:
                add(key, f, val)
    return out
