"""The measurement on Megatron's TE layer spec (over the TE test double) against the local spec with
the same weights: every statistic equal, the fused norm's output as the GEMM input, TE linears
unquantized while measured and their plan back after.

    torchrun --nproc_per_node N tests/stats/te_stats_worker.py --out DIR [--tp N] [--mla [--sp]]

--mla: a multi-latent-attention GPT (its down-projections TELinear(parallel_mode="duplicated") in
the TE spec, SNIP's duplicated linear in the local one), --sp with sequence parallelism.

Needs `tests/te_double` on PYTHONPATH (tests/stats/test_measure_te.py sets it). Both models are
measured with the same MeasureConfig formats, so TE's own scale format does not enter. Every rank writes DIR/rank<R>.json.
"""

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# te_worker.py is the double's own model builder and data (tests/te/)
from snip_megatron.models import gpt  # noqa: E402
from snip_megatron.plan import Plan  # noqa: E402
from tests.stats.measure_worker import MLA, cpu_current_device, sp_tolerant_norms  # noqa: E402
from tests.te.te_worker import SHAPE, build_te_gpt, fixed_batches, plan, require_double  # noqa: E402

# Parameter names of the TE spec that the local spec keeps elsewhere (the fused norms).
TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def local_name(te_name: str) -> str:
    for te, local in TE_TO_LOCAL.items():
        if te_name.endswith(te):
            return te_name[: -len(te)] + local
    return te_name


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mla", action="store_true")
    p.add_argument("--sp", action="store_true")
    args = p.parse_args()
    require_double()
    from megatron.core import parallel_state as ps

    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.megatron.gemm_view import te_norm
    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure_chunks

    runtime.init_process_group()
    runtime.initialize_model_parallel(tp=args.tp, pp=1, seed=1234)
    runtime.seed_all(1234)
    model = dict(mla=MLA) if args.mla else {}
    if args.sp:
        model["sequence_parallel"] = True
    the_plan = plan() if not args.mla else Plan({k: ("fp8", "fp4", "bf16")[i % 3]
                                                 for i, k in enumerate(gpt.keys(SHAPE.num_layers, MLA))})
    te_model = build_te_gpt(the_plan=the_plan, **model)  # FP8/FP4/BF16 per module through quant_recipe
    runtime.seed_all(1234)
    with sp_tolerant_norms() if args.sp else contextlib.nullcontext():
        local = build_gpt_model(SHAPE, backend="local", **model)
    local_params = dict(local.named_parameters())
    with torch.no_grad():
        for name, param in te_model.named_parameters():
            local_params[local_name(name)].copy_(param)

    # the first linear of a layer, whose GEMM input is the input norm's output (fused in the dense TE spec)
    qkv = getattr(te_model.decoder.layers[0].self_attention, "linear_qkv", None) or \
        te_model.decoder.layers[0].self_attention.linear_q_down_proj
    residual = []
    handle = qkv.register_forward_pre_hook(lambda m, a: residual.append(a[0].detach().clone()))
    params_before = {k: str(m.te_quant_params) for k, m in _te_linears(te_model).items()}
    runs_before = {k: dict(m.run_counts) for k, m in _te_linears(te_model).items()}
    config = MeasureConfig(noise_frac=0.05, seed=3, micro_batches=None)
    batches = fixed_batches()
    run = dict(seq_length=SHAPE.seq_length, micro_batch_size=2, config=config)
    with cpu_current_device() if args.sp else contextlib.nullcontext():
        te_table = measure_chunks([te_model], make_forward_step(), batches, **run)
        handle.remove()
        local_table = measure_chunks([local], make_forward_step(), batches, **run)

    te, lo = te_table.to_array(), local_table.to_array()
    scale = abs(lo).max(axis=0) + 1e-30
    worst = {f: float(abs(te[:, i] - lo[:, i]).max() / scale[i]) for i, f in enumerate(te_table.fields)}
    # The clean pass measures the first len(batches) forwards of layer 1's qkv: its GEMM input is the
    # fused norm's output, not the residual stream the module receives.
    fused = not args.mla  # MLA's TE spec keeps the input norm a module of its own
    x_sq_norm = sum(float((te_norm(qkv, x) if fused else x).float().pow(2).sum()) for x in residual[:len(batches)])
    x_sq_residual = sum(float(x.float().pow(2).sum()) for x in residual[:len(batches)])
    key = te_table.keys[0]
    out = {"worst": worst, "x_sq": te_table.row(key)["x_sq"], "x_sq_norm": x_sq_norm,
           "x_sq_residual": x_sq_residual, "keys": [str(k) for k in te_table.keys],
           "kinds": {str(k): m.parallel_mode for k, m in _te_linears(te_model).items()},
           "params_kept": params_before == {k: str(m.te_quant_params) for k, m in _te_linears(te_model).items()},
           "runs_during_measurement": {k: {r: n - runs_before[k].get(r, 0) for r, n in m.run_counts.items()
                                           if n != runs_before[k].get(r, 0)}
                                       for k, m in _te_linears(te_model).items()},
           "forward_restored": all("forward" not in vars(m) for m in _te_linears(te_model).values())}
    (Path(args.out) / f"rank{ps.get_tensor_model_parallel_rank()}.json").write_text(json.dumps(out))
    runtime.destroy()


def _te_linears(model):
    from tests.te.te_worker import planned_linears

    return planned_linears(model)


if __name__ == "__main__":
    main()
