"""A routed expert's rows under context parallelism, put back in the micro-batch's order.

One process runs expert e on every row of the micro-batch routed to it, in one GEMM, in token order:
Megatron's router routes the tokens of its input [s, b] flattened position-major
(megatron/core/transformer/moe/router.py:756, returned by TopKRouter.forward, router.py:840-868),
and the dispatcher's permute puts each expert's rows in token order (the routing map transposed to
[experts, tokens], a stable argsort: moe_utils.py:451-463; the allgather dispatcher permutes by its
local map, token_dispatcher.py:302-332; the experts run them, moe_layer.py:540-556). Under context
parallelism CP rank r holds the position chunks r and 2 CP - 1 - r of the sequence
(token_layout.cp_chunks), and, where the token dispatcher moves no token between ranks (TP, EP and
expert TP 1), its experts run its own tokens only: its rows of expert e are two runs, those of chunk
r then those of chunk 2 CP - 1 - r, and the micro-batch's rows of e are the 2 CP runs in chunk
order. So that the statistics equal one process's, an expert's probe gathers the runs over CP and
orders them (`ExpertRows.gather`: errors along tokens, G_W and dY see the rows one process's GEMM
sees, in its order), draws its noise at its rows' places in that whole (`positions`), and finds its
rows in a token sample of it (`segments`); sums over its own rows add over CP (stats/reduce.py).

Each MoE layer's router gets a forward hook (`attach`) that counts, per local expert, the rows of
each half of this rank's tokens and gathers the counts over CP: one small all-gather and one host
read per MoE layer and forward (the allgather dispatcher reads its tokens per expert to the host
too, token_dispatcher.py:317).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from snip_megatron.stats.token_layout import Segment


def _chunk_holders(cp: int) -> list[tuple[int, int]]:
    """(CP rank, its half) of each of the 2 CP position chunks, in sequence order."""
    return [(k, 0) if k < cp else (2 * cp - 1 - k, 1) for k in range(2 * cp)]


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """One expert's rows in one forward: `counts[r][h]` of CP rank r's half h of its tokens (host
    numbers, the same on every CP rank); this rank's rows are its half 0's, then its half 1's."""

    counts: tuple
    cp_rank: int
    group: object = None

    @property
    def whole(self) -> int:
        """The micro-batch's rows of the expert."""
        return sum(sum(c) for c in self.counts)

    def segments(self) -> list[Segment]:
        """Where this rank's rows lie among the micro-batch's rows of the expert (token order)."""
        start, out = 0, []
        for r, h in _chunk_holders(len(self.counts)):
            n = self.counts[r][h]
            if r == self.cp_rank and n:
                out.append(Segment(self.counts[r][0] if h else 0, start, n))
            start += n
        return sorted(out)

    def positions(self, device=None) -> torch.Tensor:
        """The places of this rank's rows in the micro-batch's rows of the expert."""
        parts = [torch.arange(s.whole, s.whole + s.rows, device=device) for s in self.segments()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)

    def gather(self, t2: torch.Tensor) -> torch.Tensor:
        """Every CP rank's rows of a [rows, features] tensor, in the micro-batch's token order."""
        cp = len(self.counts)
        most = max(sum(c) for c in self.counts)
        if most == 0:
            return t2
        buf = t2.new_zeros((most, t2.shape[1]))
        buf[:t2.shape[0]] = t2
        out = t2.new_empty((cp * most, t2.shape[1]))
        dist.all_gather_into_tensor(out, buf, group=self.group)
        parts = []
        for r, h in _chunk_holders(cp):
            first = r * most + (self.counts[r][0] if h else 0)
            parts.append(out[first:first + self.counts[r][h]])
        return torch.cat(parts)


class LayerRows:
    """One MoE layer's experts' rows of the current forward, from its router's routing map."""

    def __init__(self, layer, cp_rank: int, cp_size: int, cp_group):
        self.first, self.num = layer.local_expert_indices[0], len(layer.local_expert_indices)
        self.cp_rank, self.cp_size, self.group = cp_rank, cp_size, cp_group
        self.current: "list[ExpertRows] | None" = None
        self.handle = layer.router.register_forward_hook(self._routed)

    def _routed(self, module, args, output) -> None:
        routing_map = output[1]  # [tokens, experts], this rank's tokens position-major
        n = routing_map.shape[0]
        if n % 2:
            raise ValueError(f"context parallelism needs an even number of tokens per rank, the router got {n}")
        local = routing_map[:, self.first:self.first + self.num].reshape(2, n // 2, self.num).sum(1)
        gathered = local.new_empty((self.cp_size * 2, self.num), dtype=torch.int64)
        dist.all_gather_into_tensor(gathered, local.to(torch.int64).contiguous(), group=self.group)
        counts = gathered.view(self.cp_size, 2, self.num).tolist()  # a host read: the gathers' sizes
        self.current = [ExpertRows(tuple((c[0][e], c[1][e]) for c in counts), self.cp_rank, self.group)
                        for e in range(self.num)]

    def rows(self, expert: int) -> ExpertRows:
        """This forward's rows of local expert `expert` (its router has run)."""
        if self.current is None:
            raise RuntimeError("an expert ran before its router under context parallelism")
        return self.current[expert]

    def remove(self) -> None:
        self.handle.remove()


def moe_layers(model_chunks) -> list:
    """Every Megatron MoE layer (router, experts, token dispatcher) of the chunks."""
    return [m for c in model_chunks for m in c.modules()
            if all(hasattr(m, a) for a in ("router", "experts", "token_dispatcher", "local_expert_indices"))]


def expert_linears(layer) -> dict:
    """id(expert linear) -> its local expert index (None: a grouped linear, one GEMM per expert)."""
    from snip_megatron.models import gpt

    experts = layer.experts
    grouped = gpt.grouped_expert_linears(experts)
    if grouped is not None:  # TEGroupedMLP
        return {id(m): None for m in grouped}
    leaves = [s.suffix.rpartition(".")[2] for s in gpt.EXPERT_LINEARS]  # SequentialMLP: each local expert's
    return {id(getattr(e, leaf)): i for i, e in enumerate(experts.local_experts) for leaf in leaves}


@contextlib.contextmanager
def attached(model_chunks, cp_rank: int, cp_size: int, cp_group):
    """While inside, every MoE layer's router tallies its experts' rows over CP; yields
    {id(expert linear): (its LayerRows, local expert index or None)}."""
    layers = [LayerRows(m, cp_rank, cp_size, cp_group) for m in moe_layers(model_chunks)]
    try:
        yield {k: (rows, i) for rows, m in zip(layers, moe_layers(model_chunks))
               for k, i in expert_linears(m).items()}
    finally:
        for rows in layers:
            rows.remove()
