"""torchrun worker (2 processes): a Column->Row linear pair at TP=2 against the same pair at TP=1,
for every recipe, without and with sequence parallelism. Shapes align shards with blocks
(k=256, m=512: shards 128 and 256 wide), which TP == TP=1 requires. Rank 0 prints one JSON line
per case: the max deviation of each tensor relative to its max. A last case lays the column
linear out as Megatron's gated fc1 (partition stride 2: rank r holds column chunks r and r + 2 of
four), whose stochastically rounded G_Y draws the whole tensor's noise at those columns."""

import itertools
import json

import torch
import torch.distributed as dist

from snip_megatron.megatron import runtime
from snip_megatron.formats.precision import Formats
from snip_megatron.stats.noise import shard_indices

RECIPES = [("bf16", {}), ("fp8", {"fp8_recipe": "blockwise"}), ("fp8", {"fp8_recipe": "tensorwise"}),
           ("fp8", {"fp8_recipe": "mxfp8"}), ("fp4", {"fp4_recipe": "nvfp4"}),
           ("fp4", {"fp4_recipe": "mxfp4"})]
K, M, S, B = 256, 512, 32, 2


def _gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def run_pair(tp, precision, recipe, data, sequence_parallel, stride=1):
    from megatron.core import parallel_state as ps

    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear, QuantRowParallelLinear
    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.shapes import ModelShape

    shape = ModelShape(num_layers=1, hidden_size=K, ffn_hidden_size=M, num_attention_heads=4,
                       num_query_groups=4, vocab_size=64, seq_length=S)
    config = make_transformer_config(shape, tp=tp, sequence_parallel=sequence_parallel)
    col = QuantColumnParallelLinear(K, M, config=config, init_method=config.init_method, bias=False,
                                    gather_output=False, skip_bias_add=True, stride=stride)
    row = QuantRowParallelLinear(M, K, config=config, init_method=config.init_method, bias=False,
                                 input_is_parallel=True, skip_bias_add=True)
    group = ps.get_tensor_model_parallel_group()
    r = ps.get_tensor_model_parallel_rank()
    cols = shard_indices(M, r, tp, stride)  # this rank's features, in Megatron's layout
    x_full, w_col, w_row, gy_full = data
    with torch.no_grad():
        col.weight.copy_(w_col[cols])
        row.weight.copy_(w_row[:, cols])
    for layer, seed in ((col, 11), (row, 12)):
        layer.set_precision(precision, Formats(**recipe))
        layer.set_sr_seed(seed)
    sp = sequence_parallel and tp > 1
    s_local = S // tp if sp else S
    x = x_full[r * s_local:(r + 1) * s_local] if sp else x_full
    gy = gy_full[r * s_local:(r + 1) * s_local] if sp else gy_full
    x = x.clone().requires_grad_()
    h, _ = col(x)
    h.retain_grad()
    y, _ = row(h)
    y.backward(gy)
    out = {"h": h.detach(), "y": y.detach(), "gx": x.grad, "gh": h.grad,
           "gw_col": col.weight.grad, "gw_row": row.weight.grad}
    if tp > 1:  # gathered in rank order, then put back in feature order
        order = torch.argsort(torch.cat([shard_indices(M, i, tp, stride) for i in range(tp)]))
        out["h"], out["gh"] = _gather(out["h"], -1, group)[..., order], _gather(out["gh"], -1, group)[..., order]
        out["gw_col"], out["gw_row"] = _gather(out["gw_col"], 0, group)[order], _gather(out["gw_row"], 1, group)[:, order]
        if sp:
            out["y"], out["gx"] = _gather(out["y"], 0, group), _gather(out["gx"], 0, group)
    return out


def main():
    runtime.init_process_group()
    if not torch.cuda.is_available():
        # Megatron's sequence-parallel backward allocates on torch.cuda.current_device() inside
        # autograd, where the CPU shim's TorchFunctionMode is not active: answer "cpu" directly.
        runtime.cpu_shim.install()
        torch.cuda.current_device = lambda: torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(S, B, K, generator=g), torch.randn(M, K, generator=g) / K**0.5,
            torch.randn(K, M, generator=g) / M**0.5, torch.randn(S, B, K, generator=g))
    cases = [(sp, precision, recipe, 1) for sp, (precision, recipe) in itertools.product((False, True), RECIPES)]
    cases.append((False, "fp4", {"fp4_recipe": "nvfp4"}, 2))
    for sequence_parallel, precision, recipe, stride in cases:
        res = {}
        for tp in (1, 2):
            with runtime.megatron_runtime(tp=tp):
                res[tp] = run_pair(tp, precision, recipe, data, sequence_parallel, stride)
        report = {"recipe": precision + ":" + next(iter(recipe.values()), "bf16") + (f":stride{stride}" if stride > 1 else ""),
                  "sequence_parallel": sequence_parallel}
        for name in res[1]:
            a, b = res[1][name], res[2][name]
            report[name] = float((a - b).abs().max() / a.abs().max())
        if dist.get_rank() == 0:
            print("TP_RESULT " + json.dumps(report), flush=True)
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
