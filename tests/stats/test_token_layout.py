"""Where a rank's token rows lie in the micro-batch (stats/token_layout.py), against the noise's
positions of the same rows (stats/noise.token_positions, Megatron's split as noise.py slices it)."""

import pytest
import torch

from snip_megatron.stats import noise
from snip_megatron.stats.token_layout import Segment, row_segments


def rows_of(segments, n):
    out = torch.full((n,), -1)
    for seg in segments:
        out[seg.local:seg.local + seg.rows] = torch.arange(seg.whole, seg.whole + seg.rows)
    return out


@pytest.mark.parametrize("sp_size,cp_size", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4), (2, 4)])
def test_segments_are_megatrons_positions_and_tile_the_micro_batch(sp_size, cp_size):
    seq = 32  # one sequence: a row is a position
    n = seq // (sp_size * cp_size)
    seen = []
    for cp_rank in range(cp_size):
        for sp_rank in range(sp_size):
            segs = row_segments(n, sp_rank=sp_rank, sp_size=sp_size, cp_rank=cp_rank, cp_size=cp_size)
            rows = rows_of(segs, n)
            want = noise.token_positions(n, sp_rank=sp_rank, sp_size=sp_size, cp_rank=cp_rank, cp_size=cp_size)
            assert torch.equal(rows, torch.arange(n) if want is None else want), (sp_rank, cp_rank, segs)
            seen.append(rows)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(seq))  # every token once


def test_a_cp_rank_holds_its_two_chunks_in_order_and_rows_scale_with_the_batch():
    # 2 sequences: rows are position x 2 + sequence, so CP rank 1 of 2 (chunks 1 and 2 of 4) of a
    # 16-position micro-batch holds rows 8-15 and 16-23
    assert row_segments(16, cp_rank=1, cp_size=2) == [Segment(0, 8, 8), Segment(8, 16, 8)]
    assert row_segments(16, cp_rank=0, cp_size=2) == [Segment(0, 0, 8), Segment(8, 24, 8)]
    # with SP=2 on top, TP rank 1 holds the CP rank's second chunk only
    assert row_segments(8, sp_rank=1, sp_size=2, cp_rank=0, cp_size=2) == [Segment(0, 24, 8)]


@pytest.mark.parametrize("cp_size", [2, 4])
def test_an_experts_rows_under_cp_are_put_back_in_one_process_order(cp_size, monkeypatch):
    """stats/expert_rows.py: top-2 routing of a micro-batch of 2 sequences; each CP rank's rows of
    an expert are its tokens routed there in its token order (Megatron's permute), one process's are
    the micro-batch's in token order. Each rank's rows land at their places in one process's
    (positions, segments), and gathering every rank's rows gives one process's rows in order."""
    from snip_megatron.stats import expert_rows
    from snip_megatron.stats.token_layout import cp_chunks

    seq, b, experts = 32, 2, 4
    g = torch.Generator().manual_seed(5)
    topk = torch.rand(seq * b, experts, generator=g).topk(2, dim=1).indices
    routing = torch.zeros(seq * b, experts, dtype=torch.bool).scatter_(1, topk, True)  # rows: position x b + sequence
    half = seq // (2 * cp_size)
    ranks = []  # each CP rank's token ids (one process's row numbers), in its order
    for r in range(cp_size):
        pos = torch.cat([torch.arange(c * half, (c + 1) * half) for c in cp_chunks(r, cp_size)])
        ranks.append((pos[:, None] * b + torch.arange(b)).reshape(-1))
    for e in range(experts):
        whole = routing[:, e].nonzero().flatten()  # one process's rows of expert e, in token order
        local = [t[routing[t, e]] for t in ranks]  # each rank's, in its token order
        counts = tuple((int(routing[t[:t.numel() // 2], e].sum()), int(routing[t[t.numel() // 2:], e].sum()))
                       for t in ranks)
        most = max(map(len, local))
        padded = torch.cat([torch.cat([t.float(), torch.zeros(most - len(t))]) for t in local])[:, None]
        monkeypatch.setattr(expert_rows.dist, "all_gather_into_tensor", lambda out, buf, group=None: out.copy_(padded))
        for r in range(cp_size):
            rows = expert_rows.ExpertRows(counts, r)
            assert rows.whole == len(whole)
            assert torch.equal(whole[rows.positions()], local[r]), (e, r)
            assert torch.equal(rows_of(rows.segments(), len(local[r])), rows.positions())
            assert torch.equal(rows.gather(local[r].float()[:, None])[:, 0].long(), whole), (e, r)
