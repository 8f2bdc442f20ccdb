"""Statistics of a HybridModel (Megatron's TE-only hybrid spec, over the TE test double) in one
layout, for tests/stats/test_measure_hybrid.py to compare with one process.

    torchrun --nproc_per_node N tests/stats/hybrid_stats_worker.py --layouts tp2,pp2 --out DIR

Layouts: single_megatron / tp2 (`*-*-`, Megatron's CPU init, which is TP-invariant) and
single_name (`*-*-`) / pp2 (`*-|*-`: the same layers cut over two stages, every matrix re-drawn from its global name, as
stages draw from different RNG states). The model is built with a plan (`plan_of`) as quant_recipe (SNIP's
PlanMatcher for the hybrid family, at the stage's `select_pipeline_segment` offset), measured
through SNIP's discovery of its planned linears (the hybrid adapter, keys = hybrid layer numbers).
Rank 0 writes DIR/<layout>.npy (the reduced StatsTable) and DIR/<layout>.json (its keys, the
precisions the built linears got and the agreed inventory).
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.te.te_worker import SHAPE, fixed_batches, reinit_by_global_name, require_double  # noqa: E402

LAYOUTS = {"single_megatron": (1, 1, "*-*-", False), "tp2": (2, 1, "*-*-", False),
           "single_name": (1, 1, "*-*-", True), "pp2": (1, 2, "*-|*-", True)}
"""name: (tp, pp, pattern, re-draw every matrix from its global name)."""
SM = 90


def plan_of(inventory):
    """FP8 on odd layers, BF16 on even ones: a chunk matched at the wrong offset gets another."""
    from snip_megatron.plan import Plan

    return Plan({k: "fp8" if k.layer % 2 else "bf16" for k in inventory.keys()})


def build(tp: int, pp: int, pattern: str):
    """This rank's HybridModel chunk of `pattern` with `plan_of`'s plan, and the model's inventory."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.megatron.quant_recipe import build_recipe
    from snip_megatron.models import hybrid
    from tests.te.te_worker import formats_on

    runtime.initialize_model_parallel(tp=tp, pp=pp, seed=1234)
    runtime.seed_all(1234)
    shape = SHAPE.with_(num_layers=len(hybrid.layer_symbols(pattern)))
    inventory = hybrid.inventory(shape, pattern)
    offset, _ = hybrid.segment(pattern, ps.get_pipeline_model_parallel_rank(), pp)
    config = make_transformer_config(shape, tp=tp, pp=pp)
    config.quant_recipe = build_recipe(plan_of(inventory), layer_offset=offset, backend="te", sm=SM,
                                       formats=formats_on(SM), family=hybrid.FAMILY)
    model = HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=shape.vocab_size,
                        max_sequence_length=shape.seq_length, hybrid_layer_pattern=pattern,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                        position_embedding_type="rope",
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    return model, inventory


def measure_layout(name: str, out: Path) -> None:
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import current_plan
    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.models.agree import agree_on_model
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.measure import measure_chunks
    from snip_megatron.stats.quant_error import blockwise_error_fn

    tp, pp, pattern, by_name = LAYOUTS[name]
    model, inventory = build(tp, pp, pattern)
    if by_name:
        reinit_by_global_name(model)
    agreed = agree_on_model([model], inventory)  # every rank's discovery against the pattern's
    built = {str(k): p.value for k, p in current_plan([model]).items()}
    table = measure_chunks([model], make_forward_step(), fixed_batches(), seq_length=SHAPE.seq_length,
                           micro_batch_size=2, config=MeasureConfig(noise_frac=0.05),
                           error_fn=blockwise_error_fn(), keys=list(inventory.keys()))
    if dist.get_rank() == 0:
        np.save(out / f"{name}.npy", table.to_array())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, built)
    if dist.get_rank() == 0:
        (out / f"{name}.json").write_text(json.dumps({
            "keys": [str(k) for k in inventory.keys()], "agreed": [str(k) for k in agreed.keys()],
            "built": gathered}))
    runtime.destroy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    require_double()
    torch.set_num_threads(1)
    from snip_megatron.megatron import runtime

    runtime.init_process_group()
    for name in args.layouts.split(","):
        measure_layout(name, Path(args.out))
    dist.barrier()
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
