"""Which micro-batches of a step a measurement runs, and how their sums stand for the whole step.

A step has M micro-batches on each of the dp data-parallel replicas: dp * M in all (Megatron's
global batch / micro-batch size). A measurement of K of them (MeasureConfig.micro_batches) spreads
K over the replicas as evenly as integers allow (replica d measures floor((d+1) K / dp) -
floor(d K / dp), so with K < dp every other replica, or fewer, measures one), and each replica
takes its share at evenly spaced positions of its M (the centres of equal slices). The sample
depends only on (M, dp, K), so every rank of a replica (its TP, CP and PP ranks) picks the same
micro-batches, and a measurement is reproducible.

Each sampled micro-batch keeps the gradient scale it has in the full step (its loss is multiplied
by K_d / M, as the schedule divides by the K_d micro-batches it runs instead of M; and by 1 / CP
under context parallelism, whose ranks' gradients Megatron's DDP averages over DP x CP), and every sum
over micro-batches is multiplied by dp * M / K before the data-parallel mean: the reduced table
then estimates exactly the fields of a full measurement (sums over the M micro-batches of one
replica, averaged over replicas). Fields of the weights and the optimizer are not sums over
micro-batches and are not scaled.
"""

from __future__ import annotations

import numpy as np

from snip_megatron.stats.table import StatsTable

# Fields that are not sums over micro-batches (everything else in a layer row is).
NOT_SUMMED = {"w_sq", "k", "m", "noise_scale", "present", "ew", "ew_d",
              "adam_du_sq", "adam_dv_sq", "adam_v_sum", "adam_upd_sq", "adam_numel"}


def _share(d: int, num_local: int, dp_size: int, k: int, multiple: int) -> int:
    mine = (d + 1) * k // dp_size - d * k // dp_size
    if mine and multiple > 1:  # e.g. the interleaved schedule runs whole groups of micro-batches
        mine = min(num_local, -(-mine // multiple) * multiple)
    return mine


def _replica_picks(num_local: int, dp_size: int, k: "int | None", multiple: int) -> "list[list[int]] | None":
    """Each replica's sampled micro-batches (indices among its `num_local`); None: every one."""
    if num_local < 1:
        raise ValueError(f"a measured step needs at least one micro-batch, got {num_local}")
    if not k or k >= num_local * dp_size:
        return None
    shares = [_share(d, num_local, dp_size, k, multiple) for d in range(dp_size)]
    return [[((2 * i + 1) * num_local) // (2 * mine) for i in range(mine)] for mine in shares]


def sample_microbatches(num_local: int, dp_rank: int, dp_size: int, k: "int | None",
                        multiple: int = 1) -> tuple[list[int], int]:
    """(indices of this replica's sampled micro-batches among its `num_local`, K measured in all).
    k None or 0, or k >= dp * num_local: every micro-batch. `multiple`: a replica that measures
    any measures a multiple of it (or all), e.g. the interleaved pipeline schedule's group of
    micro-batches per virtual stage; K counts what is measured."""
    picks = _replica_picks(num_local, dp_size, k, multiple)
    if picks is None:
        return list(range(num_local)), num_local * dp_size
    return picks[dp_rank], sum(len(p) for p in picks)


def step_positions(num_local: int, dp_rank: int, dp_size: int, k: "int | None",
                   multiple: int = 1) -> list[int]:
    """Each of this replica's sampled micro-batches' position among all the step's sampled
    micro-batches, in the step's order: replica d's micro-batch i is the step's micro-batch
    d + dp * i (Megatron's sampler deals each global micro-batch across the replicas). The noise
    and the forward/backward-noise interleaving follow these positions, so a DP run draws for a
    sample what one process measuring the same samples draws."""
    picks = _replica_picks(num_local, dp_size, k, multiple)
    if picks is None:  # every micro-batch: the position is the step-wide index itself
        return [dp_rank + dp_size * i for i in range(num_local)]
    at = {g: j for j, g in enumerate(sorted(d + dp_size * i for d, mine in enumerate(picks) for i in mine))}
    return [at[dp_rank + dp_size * i] for i in picks[dp_rank]]


def summed_mask(table: StatsTable) -> np.ndarray:
    """Bool mask over `table.to_array()`: the fields that are sums over micro-batches (the
    run-level row is not)."""
    mask = np.zeros((len(table.keys) + 1, len(table.fields)), dtype=bool)
    mask[:-1] = [f.split(".", 1)[0] not in NOT_SUMMED for f in table.fields]
    return mask
