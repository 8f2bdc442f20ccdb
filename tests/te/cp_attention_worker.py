"""The TE double's context-parallel attention on two processes (gloo) against one process's.

    torchrun --nproc_per_node 2 tests/te/cp_attention_worker.py --out DIR

Needs `tests/te_double` on PYTHONPATH (double_checks.check_context_parallel_attention_... runs
it). Every rank builds the same whole-sequence Q, K, V and output gradient, computes attention and
its input gradients without CP (the reference), then takes its tokens with Megatron's own split
(megatron.core.utils.get_batch_on_this_cp_rank: chunks r and 2 CP - 1 - r) and runs the double's
DotProductAttention with the CP group (cp_comm_type 'p2p', Megatron's default). The two ranks'
outputs and gradients, put back in sequence order, are compared with the reference. Megatron's
RoPE under CP (RotaryEmbedding with the CP group, rope_utils.get_pos_emb_on_this_cp_rank) must
hold the positions the double masks by. Every rank writes DIR/rank<R>.json: {case: max abs
difference}, the refusals' messages, and the RoPE check.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

S, B = 16, 2  # whole sequence length, batch
CASES = {  # name: (qkv_format, mask, heads, groups, dk, dv)
    "causal_gqa_sbhd": ("sbhd", "causal", 4, 2, 16, 16),
    "causal_mha_bshd": ("bshd", "causal", 4, 4, 16, 16),
    "no_mask_gqa_sbhd": ("sbhd", "no_mask", 4, 2, 16, 16),
    "causal_mla_sbhd": ("sbhd", "causal", 4, 4, 32, 16),  # MLA: K wider than V (TE's p2p takes it)
}


def whole(fmt: str, heads: int, groups: int, dk: int, dv: int, seed: int):
    """q, k, v, d_out of the whole sequence in layout `fmt` (float32, the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h, d: (S, B, h, d)) if fmt == "sbhd" else (lambda h, d: (B, S, h, d))
    q, k = torch.randn(shape(heads, dk), generator=g), torch.randn(shape(groups, dk), generator=g)
    v = torch.randn(shape(groups, dv), generator=g)
    return q, k, v, torch.randn(shape(heads, dv), generator=g).flatten(2)


def attention(heads: int, groups: int, dk: int, dv: int, fmt: str, mask: str, cp_group=None):
    import transformer_engine.pytorch as te

    ranks = None if cp_group is None else dist.get_process_group_ranks(cp_group)
    return te.DotProductAttention(heads, (dk, dv), num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask,
                                  cp_group=cp_group, cp_global_ranks=ranks, cp_stream=None, cp_comm_type="p2p")


def run(module, q, k, v, d_out):
    """The output and dQ, dK, dV of one forward and backward."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v)
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def on_this_rank(tensors, fmt: str, group):
    """Megatron's split of [b, s, ...] tensors (sbhd goes through it transposed)."""
    from snip_megatron.megatron.batch import on_this_cp_rank

    to_bs = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
    batch = on_this_cp_rank({str(i): to_bs(t) for i, t in enumerate(tensors)}, group)
    return [to_bs(batch[str(i)]).contiguous() for i in range(len(tensors))]


def in_sequence_order(t: torch.Tensor, fmt: str, group) -> torch.Tensor:
    """Every rank's tokens of `t` put back in sequence order (the inverse of Megatron's split)."""
    from transformer_engine.pytorch.attention.context_parallel import chunk_order

    seq = fmt.index("s")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, seq).index_select(seq, chunk_order(len(parts), t.shape[seq]))


def compare(group) -> dict:
    worst = {}
    for seed, (name, (fmt, mask, heads, groups, dk, dv)) in enumerate(CASES.items()):
        q, k, v, d_out = whole(fmt, heads, groups, dk, dv, seed)
        want = run(attention(heads, groups, dk, dv, fmt, mask), q, k, v, d_out)
        got = run(attention(heads, groups, dk, dv, fmt, mask, group), *on_this_rank([q, k, v, d_out], fmt, group))
        worst[name] = max(float((in_sequence_order(a, fmt, group) - b).abs().max()) for a, b in zip(got, want))
        # Megatron's dynamic CP: a module built without a group gets it (and loses it) later, as TE's
        late = attention(heads, groups, dk, dv, fmt, mask)
        late.set_context_parallel_group(group, dist.get_process_group_ranks(group), None, "p2p")
        again = run(late, *on_this_rank([q, k, v, d_out], fmt, group))
        worst[name + "_set_later"] = max(float((a - b).abs().max()) for a, b in zip(again, got))
        late.set_context_parallel_group(None, None, None, "p2p")
        worst[name + "_unset"] = max(float((a - b).abs().max()) for a, b in zip(run(late, q, k, v, d_out), want))
    return worst


def refusals(group) -> dict:
    """What TE's CP runs differently, or not at all: each message (or "accepted")."""
    ranks = dist.get_process_group_ranks(group)
    q = torch.randn(S // 2, B, 4, 16)
    attempts = {
        "a2a": lambda: attention(4, 4, 16, 16, "sbhd", "causal").set_context_parallel_group(group, ranks, None, "a2a"),
        "all_gather": lambda: attention(4, 4, 16, 16, "sbhd", "causal").set_context_parallel_group(
            group, ranks, None, "all_gather"),
        "a2a+p2p": lambda: attention(4, 4, 16, 16, "sbhd", "causal").set_context_parallel_group(
            [group, group], ranks, None, "a2a+p2p"),
        "not a group": lambda: attention(4, 4, 16, 16, "sbhd", "causal").set_context_parallel_group(
            object(), ranks, None, "p2p"),
        "other ranks": lambda: attention(4, 4, 16, 16, "sbhd", "causal").set_context_parallel_group(
            group, ranks[::-1], None, "p2p"),
        "padding_causal": lambda: attention(4, 4, 16, 16, "sbhd", "padding_causal", group)(q, q, q),
        "causal_bottom_right": lambda: attention(4, 4, 16, 16, "sbhd", "causal_bottom_right", group)(q, q, q),
        "thd": lambda: attention(4, 4, 16, 16, "sbhd", "causal", group)(q, q, q, qkv_format="thd"),
        "odd local length": lambda: attention(4, 4, 16, 16, "sbhd", "causal", group)(q[:7], q[:7], q[:7]),
        "causal cross-attention": lambda: attention(4, 4, 16, 16, "sbhd", "causal", group)(q, q[:4], q[:4]),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "accepted"
        except (NotImplementedError, AssertionError, ValueError) as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def rope_positions(group) -> bool:
    """Megatron's RoPE on a CP rank (rotary_pos_embedding.RotaryEmbedding with the CP group) holds
    the whole sequence's rows at the positions the double gives this rank's tokens."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformer_engine.pytorch.attention.context_parallel import positions_on_rank

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    full, mine = rope(S), rope(S, cp_group=group)
    at = positions_on_rank(dist.get_rank(group), dist.get_world_size(group), S // dist.get_world_size(group))
    return mine.shape[0] == S // 2 and torch.equal(mine, full.index_select(0, at))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from snip_megatron.megatron import cpu_shim, runtime

    runtime.init_process_group()
    cpu_shim.install()  # Megatron's RoPE slice asks for pinned memory and .cuda()
    group = dist.new_group(list(range(dist.get_world_size())))
    result = {"worst": compare(group), "refusals": refusals(group), "rope": rope_positions(group)}
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
