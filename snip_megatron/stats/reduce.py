"""Reduce a statistics table across ranks: one fixed-size collective per parallel dimension.

- TP: squared norms (and inner products) of sharded tensors are summed over the TP group;
  replicated ones are counted once (zeroed on TP ranks > 0 before the sum, NaN-safely). With
  sequence parallelism the token dim is sharded too: statistics of a column-parallel layer's
  input side (X, G_X: [s/tp, b, k]) and of a row-parallel layer's output side (Y, G_Y) are sums
  over TP as well; statistics the hooks compute on tokens gathered over TP stay replicated.
  A duplicated linear (MLA's down-projections in the TE spec: the whole weight on every TP rank)
  has nothing sharded by features; under SP each rank holds its own tokens of X and Y (and their
  gradients), so those per-token sums add over TP, and everything else is replicated.
- CP: the ranks of a CP group hold different tokens of the same sequences, one replica between
  them. Sums over this rank's tokens (the norms of X, Y and their gradients, their inner
  products with the noise and with E_X) add over CP; everything else the hooks compute on the
  micro-batch's tokens gathered over CP (errors, dY, G_W), or on the weights, is the same on
  every CP rank, and is counted once (the mean; the loss: the mean of the ranks' means). AdamW
  state of a distributed optimizer is sharded over DP x CP: summed.
- DP: replicas are averaged over the data-parallel group (without CP).
- Routed experts (an MoE layer's expert units) live on the expert grid ETP x EP x EDP x PP
  instead (Megatron's MoE parallel folding): each rank's local experts have added into the unit's
  row; expert TP (ETP) is reduced like TP (the experts' tokens are whole on every ETP rank: no
  sequence parallelism), expert parallelism (EP) sums the disjoint experts (the unit's shape and
  presence counted once), and the expert-data-parallel group (EDP) sums the tokens of its
  replicas; sums over tokens are then divided by the dense DP size, so an expert row is in the
  dense rows' units (a replica's sums, averaged). Weight and optimizer fields are averaged
  over EDP (summed when the distributed optimizer shards them over it). Under context parallelism
  (at TP = EP = ETP = 1) the EDP group holds the CP ranks, each of whose experts ran its own
  tokens: their sums over its own rows add over EDP as above, while what the hooks computed on
  the rows gathered over CP (expert_rows.py: errors, dY, G_W) is the same on every CP rank and
  is counted once (divided by CP as well).
- PP: every stage fills its own rows; a sum over the PP group gathers them on the first stage
  (or on every stage with `pp_to_all`). Global rank 0 then holds the whole table.

The `*_tensor` functions work on the table as a device tensor (`StatsTable.to_array` layout), so
a measurement moves its statistics to the host once, after the last reduction.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from snip_megatron.models.inventory import ParallelKind
from snip_megatron.stats.table import BASE_FIELDS, StatsTable

# Fields that are sums over a TP-sharded tensor, per kind of layer (anything else is replicated).
# dY of a row-parallel layer and the per-token <G_Y, dY> are all-reduced in the hooks (they are
# partial sums on each rank), so dy_sq of proj/fc2 and gdy_sq everywhere are replicated.
_SHARDED_ALWAYS = {"w_sq", "gw_sq", "bwd_dgw_sq", "adam_du_sq", "adam_dv_sq", "adam_v_sum",
                   "adam_upd_sq", "adam_numel",
                   "ew", "ew_d", "gw_ew"}
_SHARDED_COLUMN = {"y_sq", "gy_sq", "fwd_zg_clean", "fwd_zg_noisy", "fwd_z_sq", "egy_d", "egy_w", "dy_sq"}
_SHARDED_ROW = {"x_sq", "gx_sq", "bwd_eta_sq", "ex", "ex_w", "gx_ex"}
# Sequence parallelism: statistics the hooks take on this rank's tokens of a token-sharded tensor
# (the errors, dY and G_W are computed on tokens gathered over TP and keep the rules above).
_TOKEN_SHARDED_COLUMN = {"x_sq", "n", "gx_sq", "gx_ex", "bwd_eta_sq"}
_TOKEN_SHARDED_ROW = {"y_sq", "gy_sq", "fwd_zg_clean", "fwd_zg_noisy", "fwd_z_sq"}
# A duplicated linear under SP: both its input and its output are this rank's tokens.
_TOKEN_SHARDED_DUPLICATED = _TOKEN_SHARDED_COLUMN | _TOKEN_SHARDED_ROW
# Context parallelism: the sums over this rank's tokens, whatever the kind (the hooks gather the rest).
_CP_SUMMED = _TOKEN_SHARDED_COLUMN | _TOKEN_SHARDED_ROW
ADAM_FIELDS = ("adam_du_sq", "adam_dv_sq", "adam_v_sum", "adam_upd_sq", "adam_numel")


def tp_sharded(field: str, kind: ParallelKind, sequence_parallel: bool = False) -> bool:
    """Is `field` of a linear of parallel `kind` a sum over TP shards (True) or replicated (False)?"""
    base = field.split(".", 1)[0]
    kind = ParallelKind(kind)
    if kind is ParallelKind.DUPLICATED:
        return sequence_parallel and base in _TOKEN_SHARDED_DUPLICATED
    column = kind is ParallelKind.COLUMN
    sharded = _SHARDED_ALWAYS | (_SHARDED_COLUMN if column else _SHARDED_ROW)
    if sequence_parallel:
        sharded = sharded | (_TOKEN_SHARDED_COLUMN if column else _TOKEN_SHARDED_ROW)
    return base in sharded


def tp_sharded_mask(table: StatsTable, kinds, sequence_parallel: bool = False) -> np.ndarray:
    """Bool mask over `table.to_array()`; the run-level row counts as replicated. `kinds`: the
    ParallelKind of the keys this rank holds (an Inventory, or a mapping key -> kind); a row it
    does not hold is zero on all its TP peers too (they hold the same layers), so it is left
    replicated."""
    kind_of = {e.key: e.kind for e in kinds} if not hasattr(kinds, "items") else dict(kinds)
    mask = np.zeros((len(table.keys) + 1, len(table.fields)), dtype=bool)
    for i, k in enumerate(table.keys):
        if k in kind_of:
            mask[i] = [tp_sharded(f, kind_of[k], sequence_parallel) for f in table.fields]
    return mask


def cp_summed_mask(table: StatsTable) -> np.ndarray:
    """Bool mask over `table.to_array()`: the fields summed over CP (the run-level row: none)."""
    mask = np.zeros((len(table.keys) + 1, len(table.fields)), dtype=bool)
    mask[:-1] = [f.split(".", 1)[0] in _CP_SUMMED for f in table.fields]
    return mask


def _device():
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def megatron_groups():
    """(TP group, CP group, data-parallel group without CP, PP group) of Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(),
            ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group())


def reduce_tp_dp_tensor(t: torch.Tensor, tp_mask: torch.Tensor, adam_cols: list, *, tp_group, dp_group,
                        cp_group=None, cp_mask: "torch.Tensor | None" = None,
                        adam_dp_sharded: bool = False) -> torch.Tensor:
    """TP sum (replicated fields counted once), the CP sum of `cp_mask`'s fields (the others
    counted once), then the DP mean, of a table tensor."""
    if dist.get_rank(tp_group) > 0:
        t = torch.where(tp_mask, t, torch.zeros_like(t))  # where(), not *0: NaN must survive
    else:
        t = t.clone()
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(t, group=tp_group)
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp > 1:
        dist.all_reduce(t, group=cp_group)
        once = ~cp_mask
        if adam_dp_sharded:  # the optimizer's shards over DP x CP add up
            once[:-1, adam_cols] = False
        t = torch.where(once, t / cp, t)
    dp = dist.get_world_size(dp_group)
    if dp > 1:
        if adam_dp_sharded:  # shards of the optimizer state: the mean of dp * shard sums = the sum
            t[:-1, adam_cols] *= dp
        dist.all_reduce(t, group=dp_group)
        t /= dp
    return t


# Fields of an expert unit's row that every EP rank holds alike (the others add over its experts).
_EP_REPLICATED = {"present", "k", "m", "noise_scale"}


def expert_groups():
    """(expert-TP group, expert-parallel group, expert-data-parallel group) of Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group(),
            ps.get_expert_data_parallel_group())


def reduce_experts_tensor(t: torch.Tensor, rows: list, etp_mask: torch.Tensor, summed: torch.Tensor,
                          adam_cols: list, *, etp_group, ep_group, edp_group, dense_dp: int,
                          adam_dp_sharded: bool = False, cp: int = 1,
                          cp_mask: "torch.Tensor | None" = None) -> torch.Tensor:
    """The expert rows `rows` of a table tensor `t` (local sums, before any reduction) reduced over
    ETP, EP and EDP (module docstring); the other rows come back as they are. `etp_mask`: the
    TP-sharded fields, `summed`: the fields that are sums over tokens, both masks over `t`; with
    `cp` > 1, `cp_mask`: the fields summed over this CP rank's own rows (the other sums were taken
    on rows gathered over CP)."""
    out = t.clone()
    if not rows:
        return out
    idx = torch.tensor(rows, device=t.device)
    e = t.index_select(0, idx)
    if dist.get_rank(etp_group) > 0:
        e = torch.where(etp_mask.index_select(0, idx), e, torch.zeros_like(e))
    if dist.get_world_size(etp_group) > 1:
        dist.all_reduce(e, group=etp_group)
    if dist.get_world_size(ep_group) > 1:
        if dist.get_rank(ep_group) > 0:
            cols = torch.tensor([BASE_FIELDS.index(f) for f in sorted(_EP_REPLICATED)], device=t.device)
            keep = torch.ones(e.shape[1], dtype=torch.bool, device=t.device)
            keep[cols] = False
            e = torch.where(keep, e, torch.zeros_like(e))
        dist.all_reduce(e, group=ep_group)
    edp = dist.get_world_size(edp_group)
    if edp > 1:
        dist.all_reduce(e, group=edp_group)
    scale = torch.full((e.shape[1],), 1.0 / edp, dtype=e.dtype, device=e.device)
    scale[summed.index_select(0, idx)[0]] = 1.0 / dense_dp  # tokens of every replica: the dense units
    if cp > 1:  # sums over rows gathered over CP: every CP rank's alike
        scale[summed.index_select(0, idx)[0] & ~cp_mask.index_select(0, idx)[0]] = 1.0 / (dense_dp * cp)
    if adam_dp_sharded:
        scale[adam_cols] = 1.0  # the optimizer's shards over EDP add up
    out[idx] = e * scale
    return out


def gather_pp_tensor(t: torch.Tensor, *, pp_group, to_all: bool = False) -> torch.Tensor:
    """Sum the stages' rows over the PP group onto its first stage (every stage with to_all)."""
    if dist.get_world_size(pp_group) == 1:
        return t
    t = t.clone()
    if to_all:
        dist.all_reduce(t, group=pp_group)
    else:
        dist.reduce(t, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    return t


def reduce_tp_dp(table: StatsTable, *, kinds, tp_group=None, dp_group=None, adam_dp_sharded: bool = False,
                 use_megatron_groups: bool = True, sequence_parallel: bool = False) -> StatsTable:
    """TP sum (replicated counted once), CP, then DP mean. Every rank gets the values of its rows."""
    if not dist.is_initialized():
        return table.copy()
    cp_group = None
    if use_megatron_groups and tp_group is None and dp_group is None:
        tp_group, cp_group, dp_group, _ = megatron_groups()
    dev = _device()
    mask = torch.from_numpy(tp_sharded_mask(table, kinds, sequence_parallel)).to(dev)
    t = reduce_tp_dp_tensor(torch.from_numpy(table.to_array()).to(dev), mask,
                            [table.col(f) for f in ADAM_FIELDS], tp_group=tp_group, dp_group=dp_group,
                            cp_group=cp_group, cp_mask=torch.from_numpy(cp_summed_mask(table)).to(dev),
                            adam_dp_sharded=adam_dp_sharded)
    return StatsTable.from_array(table.keys, t.cpu().numpy(), table.precisions)


def gather_pp(table: StatsTable, *, pp_group=None, to_all: bool = False,
              use_megatron_groups: bool = True) -> StatsTable:
    """Sum the stages' rows over the PP group onto its first stage (every stage with to_all)."""
    if not dist.is_initialized():
        return table.copy()
    if use_megatron_groups and pp_group is None:
        pp_group = megatron_groups()[3]
    t = gather_pp_tensor(torch.from_numpy(table.to_array()).to(_device()), pp_group=pp_group, to_all=to_all)
    return StatsTable.from_array(table.keys, t.cpu().numpy(), table.precisions)


def reduce_stats(table: StatsTable, *, kinds, adam_dp_sharded: bool = False, pp_to_all: bool = False,
                 sequence_parallel: bool = False) -> StatsTable:
    """The full reduction with Megatron's groups: TP, CP, DP, then PP onto global rank 0."""
    return gather_pp(reduce_tp_dp(table, kinds=kinds, adam_dp_sharded=adam_dp_sharded,
                                  sequence_parallel=sequence_parallel),
                     to_all=pp_to_all)
