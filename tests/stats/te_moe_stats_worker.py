"""An MoE GPT on Megatron's TE spec with grouped experts (TEGroupedMLP over the TE double's
GroupedLinear) against the local spec's SequentialMLP with the same weights: every statistic
equal; then SNIP's split padding under an FP8 plan (TE's refusal of unaligned splits without it).

    torchrun --nproc_per_node 1 tests/stats/te_moe_stats_worker.py --out DIR
    torchrun --nproc_per_node 2 tests/stats/te_moe_stats_worker.py --out DIR --tp2-sp-ep2

With --tp2-sp-ep2: both models at TP=2 with sequence parallelism and EP=2 (expert TP 1), the
tables only (the local spec's equals one process's: tests/stats/test_measure_moe_parallel.py).
Needs `tests/te_double` on PYTHONPATH (tests/stats/test_measure_te.py sets it). Writes DIR/rank<r>.json.
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

from tests.stats.measure_worker import SHAPE  # noqa: E402
from tests.stats.te_stats_worker import local_name  # noqa: E402
from tests.te.te_worker import GPU_DEFAULTS, fixed_batches, require_double  # noqa: E402

# layer 1 MoE (4 experts, top-2), layer 2 dense
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0],
           moe_aux_loss_coeff=1e-2)


def grouped_to_local(name: str) -> str:
    """`...mlp.experts.linear_fc1.weight<i>` -> `...mlp.experts.local_experts.<i>.linear_fc1.weight`."""
    head, sep, tail = name.partition("mlp.experts.")
    if not sep:
        return local_name(name)
    linear, param = tail.split(".")
    return f"{head}mlp.experts.local_experts.{param.removeprefix('weight')}.{linear}.weight"


def build_te_moe(moe=MOE, **parallel):
    """This rank's MoE GPT on Megatron's TE spec with grouped experts (`moe`: its MoE settings)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from snip_megatron.megatron.model import make_transformer_config

    from megatron.core import parallel_state as ps

    config = make_transformer_config(SHAPE, tp=ps.get_tensor_model_parallel_world_size(), **GPU_DEFAULTS, **moe,
                                     **parallel, moe_grouped_gemm=True)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=SHAPE.vocab_size,
                    max_sequence_length=SHAPE.seq_length, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope")


def train_forward_backward(model, batch):
    from snip_megatron.megatron.batch import make_forward_step

    step = make_forward_step()
    out, loss_fn = step(iter([batch]), model)
    loss = loss_fn(out)[0]
    loss.backward()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tp2-sp-ep2", action="store_true")
    args = p.parse_args()
    require_double()
    from snip_megatron.formats.precision import Precision
    from snip_megatron.megatron import grouped_padding, runtime
    from snip_megatron.megatron.apply import apply_plan
    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.models import gpt
    from snip_megatron.plan import Plan
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure_chunks
    from tests.pretrain.pretrain_worker import use_the_doubles_gpu

    from tests.stats.measure_worker import cpu_current_device, sp_tolerant_norms

    use_the_doubles_gpu()
    runtime.init_process_group()
    wide = args.tp2_sp_ep2
    runtime.initialize_model_parallel(tp=2 if wide else 1, pp=1, seed=1234, ep=2 if wide else 1, etp=1)
    parallel = dict(sequence_parallel=True, expert_model_parallel_size=2, expert_tensor_parallel_size=1) \
        if wide else {}
    runtime.seed_all(1234)
    te_model = build_te_moe(**parallel)
    runtime.seed_all(1234)
    with sp_tolerant_norms() if wide else contextlib.nullcontext():
        local = build_gpt_model(SHAPE, backend="local", **MOE, **parallel)
    local_params = dict(local.named_parameters())
    with torch.no_grad():
        for name, param in te_model.named_parameters():
            local_params[grouped_to_local(name)].copy_(param)
    fc1 = te_model.decoder.layers[0].mlp.experts.linear_fc1
    inv = gpt.of_config(te_model.config)
    # FP8 on the experts: their token splits must be padded to 16 rows (SM90: blockwise FP8)
    apply_plan([te_model], Plan({k: Precision.FP8 if gpt.is_expert(k) else Precision.BF16 for k in inv.keys()}), sm=90)
    config = MeasureConfig(noise_frac=0.05, seed=3, micro_batches=None)
    batches = fixed_batches()
    run = dict(seq_length=SHAPE.seq_length, micro_batch_size=2, config=config)
    with cpu_current_device() if wide else contextlib.nullcontext():
        te_table = measure_chunks([te_model], make_forward_step(), batches, **run)
        local_table = measure_chunks([local], make_forward_step(), batches, **run)
    te, lo = te_table.to_array(), local_table.to_array()
    scale = abs(lo).max(axis=0) + 1e-30
    worst = {f: float(abs(te[:, i] - lo[:, i]).max() / scale[i]) for i, f in enumerate(te_table.fields)}
    out = {"worst": worst, "keys": [str(k) for k in te_table.keys],
           "expert_n": te_table.get(gpt.LayerKey(1, "expert_fc1"), "n"),
           "measured_unquantized": fc1.run_counts.get("blockwise", 0) == 0 and "forward" not in vars(fc1),
           "local_experts": fc1.num_gemms, "dp_size": te_table.globals_["dp_size"]}
    if wide:
        import torch.distributed as dist

        (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
        runtime.destroy()
        return

    for param in te_model.parameters():  # Megatron's DDP would give them: TE fuses wgrad into main_grad
        param.requires_grad_(True)
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    # a quantized step: without SNIP's padding TE refuses the unaligned splits, with it they are padded
    try:
        train_forward_backward(te_model, batches[0])
        out["unpadded"] = "ran"
    except RuntimeError as error:
        out["unpadded"] = str(error)
    grouped_padding.install([te_model])
    train_forward_backward(te_model, batches[0])
    out["padded_splits"] = fc1.last_splits
    out["padded_label"] = fc1.last_run.label
    # a re-plan switches the grouped linear's recipe: BF16 needs no padding
    apply_plan([te_model], Plan({k: Precision.BF16 for k in inv.keys()}), sm=90)
    train_forward_backward(te_model, batches[1])
    out["bf16_splits"] = fc1.last_splits
    out["bf16_label"] = fc1.last_run.label
    (Path(args.out) / "rank0.json").write_text(json.dumps(out))
    runtime.destroy()


if __name__ == "__main__":
    main()
