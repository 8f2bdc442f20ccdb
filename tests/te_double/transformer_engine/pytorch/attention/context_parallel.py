"""Test double of TE 2.14's context-parallel attention (transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py, cited below as cp.py; dot_product_attention.py as dpa.py,
utils.py as utils.py, all in that folder at tag v2.14).

What it models is the result of `attn_forward_func_with_cp` with cp_comm_type 'p2p'
(`AttnFuncWithCPAndKVP2P`, cp.py:1246-2766), not its kernels or its ring:
- the tokens are re-ordered before attention by Megatron's load-balanced split (DualChunkSwap,
  cp.py:3966-4004: the sequence in 2 x CP chunks, rank r holds chunks r and 2 CP - 1 - r, in that
  order; Megatron's get_batch_on_this_cp_rank and get_pos_emb_on_this_cp_rank make that split);
- each rank's queries attend to the keys and values of the whole sequence: with a causal mask, to
  those at global positions up to their own (the diagonal, lower- and upper-triangle tiles,
  cp.py:1648-1747 with cp_p2p_fwd_prepare_qkv, cp.py:647-764, whose tiles together are the causal
  mask by global position); with no mask, to all of them ("all" tiles, cp.py:1745-1747);
- the gradients of K and V flow back to the rank that holds them (the dK/dV ring of the backward,
  cp.py:2310-2347, 2555-2566, 2674-2675).
The double all-gathers K and V over the CP group (autograd-correct: each rank's gradient of the
gathered K/V is summed over the group and its owner keeps its slice), puts the chunks in global
order and masks by global position. The ring, its online softmax correction (cp.py:1795-1880) and
its per-step dropout RNG states are not modelled: with dropout the double drops each probability of
this rank's queries independently, as TE does, from other random numbers.

Refused (NotImplementedError, by name) where the double does not model TE: cp_comm_type 'a2a',
'all_gather' and 'a2a+p2p' (a list of groups; cp.py:4027-4043, dispatched at cp.py:4117-4151);
qkv_format 'thd' (packed sequences); masks other than 'causal' and 'no_mask' (TE's CP backends
take bshd/sbhd with those only, utils.py:756-766; the unfused backend is off under CP,
utils.py:768-772); causal cross-attention (utils.py:786-791, 813-818). TE's own assertions are
kept: a cp_group that is not a ProcessGroup (cp.py:4043-4046), a local sequence length that is odd
(cp.py:1446-1448)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

COMM_TYPES = ("p2p",)
"""The cp_comm_types the double models."""
CP_MASK_TYPES = ("causal", "no_mask")


def _refuse(what: str):
    raise NotImplementedError(f"transformer_engine test double: DotProductAttention {what} is "
                              f"not modelled")


def cp_size_of(cp_group, cp_global_ranks: Optional[Sequence[int]], cp_comm_type: str) -> int:
    """The CP size a (cp_group, cp_global_ranks, cp_comm_type) setting runs (dpa.py:1237-1244: 1
    without a group); refuses what the double does not model and checks the ranks TE sends to."""
    if cp_group is None:
        return 1
    if isinstance(cp_group, list) or cp_comm_type == "a2a+p2p":
        _refuse("hierarchical context parallelism (cp_comm_type='a2a+p2p', a list of cp_groups)")
    if not isinstance(cp_group, dist.ProcessGroup):  # TE asserts it (cp.py:4043-4046)
        raise AssertionError(f"cp_group must be {dist.ProcessGroup} type for {cp_comm_type=}!")
    size = dist.get_world_size(cp_group)
    if size > 1 and cp_comm_type not in COMM_TYPES:
        _refuse(f"context parallelism with cp_comm_type={cp_comm_type!r} (modelled: {', '.join(COMM_TYPES)})")
    ranks = dist.get_process_group_ranks(cp_group)
    if cp_global_ranks is not None and list(cp_global_ranks) != ranks:
        # p2p sends to cp_global_ranks[(rank + 1) % cp_size] (cp.py:1308): they must be the group's
        raise ValueError(f"cp_global_ranks {list(cp_global_ranks)} are not the global ranks {ranks} "
                         f"of cp_group")
    return size


def check_inputs(qkv_format: str, mask_type: str, q: torch.Tensor, k: torch.Tensor) -> None:
    """What TE's context-parallel attention takes, as far as the double models it."""
    if qkv_format not in ("sbhd", "bshd"):
        _refuse(f"context parallelism with qkv_format={qkv_format!r}")
    if mask_type not in CP_MASK_TYPES:
        _refuse(f"context parallelism with attn_mask_type={mask_type!r} (TE: causal or no_mask "
                f"for bshd/sbhd)")
    seq_dim = qkv_format.index("s")
    if q.shape[seq_dim] % 2 or k.shape[seq_dim] % 2:  # cp.py:1446-1448
        raise AssertionError("Sequence length per GPU needs to be divisible by 2!")
    if mask_type == "causal" and q.shape[seq_dim] != k.shape[seq_dim]:
        _refuse("context parallelism with causal cross-attention (TE has no backend for it)")


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim `dim` in rank order; backward: the gradient summed over the group, this
    rank's slice (each rank's queries contributed to every rank's keys and values)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.local = dist.get_rank(group), t.shape[dim]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local), None, None


def chunk_order(cp_size: int, local: int) -> torch.Tensor:
    """Indices into the rank-order gather of `local`-token slices that put the sequence in global
    order: global chunk c lies on rank c (its first half) for c < CP, else on rank 2 CP - 1 - c (its
    second half)."""
    half = local // 2
    index = []
    for c in range(2 * cp_size):
        owner, second = (c, 0) if c < cp_size else (2 * cp_size - 1 - c, 1)
        start = owner * local + second * half
        index.extend(range(start, start + half))
    return torch.tensor(index)


def positions_on_rank(rank: int, cp_size: int, local: int, device=None) -> torch.Tensor:
    """Global positions of a rank's `local` tokens: chunk rank, then chunk 2 CP - 1 - rank."""
    half = local // 2
    first, second = rank * half, (2 * cp_size - 1 - rank) * half
    return torch.cat([torch.arange(first, first + half, device=device),
                      torch.arange(second, second + half, device=device)])


def gather_kv(k: torch.Tensor, v: torch.Tensor, seq_dim: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence, in global order, on every rank of `group`."""
    cp_size, local = dist.get_world_size(group), k.shape[seq_dim]
    order = chunk_order(cp_size, local).to(k.device)
    return tuple(_GatherSequence.apply(t, seq_dim, group).index_select(seq_dim, order) for t in (k, v))


def causal_mask_on_rank(group, sq: int, device) -> torch.Tensor:
    """[sq, sq * CP] bool, True where a key's global position is after the query's."""
    rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    q_pos = positions_on_rank(rank, cp_size, sq, device)
    k_pos = torch.arange(sq * cp_size, device=device)
    return k_pos.view(1, -1) > q_pos.view(-1, 1)
