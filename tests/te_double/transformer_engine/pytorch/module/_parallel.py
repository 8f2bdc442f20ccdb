"""The tensor-parallel communication TE's linears do around their GEMMs, as autograd functions.

    column, no SP: input as is,          dgrad all-reduced
    column, SP:    input all-gathered along dim 0 (sequence), dgrad reduce-scattered
    row, no SP:    output all-reduced,   grad_output as is
    row, SP:       output reduce-scattered along dim 0, grad_output all-gathered

TE gathers FP8/FP4 data; the double gathers the high-precision tensor and quantizes the whole of
it, which equals TE's quantize-with-TP-amax-then-gather for the recipes the double runs.
Collectives are plain all_gather / all_reduce so they also run on gloo (CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


def _all_gather_dim0(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(t: torch.Tensor, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[0] % world:
        raise ValueError(f"sequence length {t.shape[0]} is not divisible by the TP size {world}")
    return _all_reduce(t, group).chunk(world, dim=0)[rank].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        return _all_reduce(t.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _all_gather_dim0(t, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad.clone(), ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _reduce_scatter_dim0(t.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def column_input(t: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The GEMM input of a column-parallel layer from its (local) input."""
    return _GatherSequence.apply(t, group) if sequence_parallel else _CopyToGroup.apply(t, group)


def gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(t, group)


def row_output(t: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The output of a row-parallel layer from its partial GEMM output."""
    return _ScatterSequence.apply(t, group) if sequence_parallel else _ReduceFromGroup.apply(t, group)
