"""The reduction over context parallelism on its own: two CP ranks (one data-parallel replica)
reduce a table over Megatron's CP group. Used by tests/stats/test_reduce_cp.py (a model at CP=2:
tests/stats/test_measure_te.py).

    torchrun --nproc_per_node 2 tests/stats/cp_worker.py --out FILE.npy
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist

from snip_megatron.megatron import cpu_shim, runtime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runtime.init_process_group()
    from megatron.core import parallel_state as ps

    cpu_shim.install()
    ps.initialize_model_parallel(context_parallel_size=2)
    from snip_megatron.models import gpt
    from snip_megatron.shapes import get_shape
    from snip_megatron.stats.reduce import (ADAM_FIELDS, cp_summed_mask, megatron_groups, reduce_tp_dp_tensor,
                                            tp_sharded_mask)
    from snip_megatron.stats.table import StatsTable

    tp_group, cp_group, dp_group, _ = megatron_groups()
    inventory = gpt.inventory(get_shape("llama_tiny").with_(num_layers=1))
    layout = StatsTable(keys=inventory.keys())
    rank = dist.get_rank()
    t = torch.full((len(layout.keys) + 1, len(layout.fields)), float(rank + 1), dtype=torch.float64)
    adam = [layout.col(f) for f in ADAM_FIELDS]
    masks = torch.from_numpy(tp_sharded_mask(layout, inventory)), torch.from_numpy(cp_summed_mask(layout))
    out = [reduce_tp_dp_tensor(t, masks[0], adam, tp_group=tp_group, dp_group=dp_group, cp_group=cp_group,
                               cp_mask=masks[1], adam_dp_sharded=sharded) for sharded in (True, False)]
    if rank == 0:
        sizes = [np.full(out[0].shape, float(dist.get_world_size(g))) for g in (dp_group, cp_group)]
        np.save(args.out, np.stack([*(o.numpy() for o in out), *sizes]))
    dist.barrier()
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
