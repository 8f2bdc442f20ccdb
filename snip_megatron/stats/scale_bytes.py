"""The bytes one measurement holds on a rank, read off the code in stats/ (collector.py,
weights.py, tokens.py, noise.py, adam.py) tensor by tensor: each hook's working set, the layer
inputs the hooks hold over the pipeline schedule, the AdamW read and the device tables (the
memory part of stats/scale_model.py; see its docstring). Pure Python: no torch."""

from __future__ import annotations

import math

from snip_megatron.models import gpt
from snip_megatron.models.inventory import ParallelKind
from snip_megatron.stats.scale_layout import WEIGHT_BLOCK_ELEMS, MeasureLayout, schedule

TOKEN_CHUNK = 16
NOISE_CHUNK = 1 << 22  # noise.CHUNK_ELEMS
BLOCK_ELEMS = 1 << 22  # tokens.BLOCK_ELEMS, adam.BLOCK
BLOCK_ROWS = 128  # weights.BLOCK_ROWS
FIELDS = 21 + 2 * 10  # table.field_names() with FP8 and FP4


def _kept(n: int, stride: int) -> int:
    if stride == 1 or n < stride * TOKEN_CHUNK:
        return n
    chunks = -(-n // TOKEN_CHUNK)
    picked = -(-chunks // stride)
    return TOKEN_CHUNK * (picked - 1) + min(TOKEN_CHUNK, n - TOKEN_CHUNK * (picked - 1) * stride)


def _block_rows(m: int, k: int, max_elems: int = WEIGHT_BLOCK_ELEMS) -> int:
    if m * k <= max_elems:
        return m
    return max(BLOCK_ROWS, (max_elems // k) // BLOCK_ROWS * BLOCK_ROWS)


def _copy(elems: int, dtype_bytes: int) -> int:
    """Bytes of a float32 copy of a tensor with `dtype_bytes` per element (none when float32)."""
    return 0 if dtype_bytes == 4 else 4 * elems


def _norm_temp(elems: int, dtype_bytes: int) -> int:
    """tokens.sum_sq / dot: a float32 block (a copy unless float32) and its square."""
    block = min(elems, BLOCK_ELEMS)
    return 4 * block + _copy(block, dtype_bytes)


def _kept_min(n: int, stride: int, min_chunks: int) -> int:
    """tokens.sample_rows(n, stride, min_chunks=...).kept: every row when fewer than `min_chunks`
    chunks would be sampled."""
    return n if -(-(-(-n // TOKEN_CHUNK)) // stride) < min_chunks else _kept(n, stride)


def _index(kept: int, n: int) -> int:
    """A token sample's row index (int64), when it samples."""
    return 8 * kept if kept < n else 0


def _gram_work(n: int, d: int, dtype_bytes: int) -> int:
    """tokens.chunk_grams' working set on an [n, d] operand: a block of rows as float32 (a copy
    unless float32) and, for the block that ends in a partial chunk, its zero-padded copy."""
    rows = max(TOKEN_CHUNK, BLOCK_ELEMS // max(d, 1) // TOKEN_CHUNK * TOKEN_CHUNK)  # tokens._block(t2, TOKEN_CHUNK)
    last = n - (-(-n // rows) - 1) * rows
    pad = 4 * (last + -last % TOKEN_CHUNK) * d if last % TOKEN_CHUNK else 0
    return max(_copy(min(n, rows) * d, dtype_bytes), _copy(last * d, dtype_bytes) + pad)


def _grams(n: int, kx: int, my: int, dtype_bytes: int) -> int:
    """tokens.WgradNormEstimate: the chunk Grams of G_Y, then of X (each [chunks, 16, 16] float32,
    made with `_gram_work`), then their product."""
    out = 4 * -(-n // TOKEN_CHUNK) * TOKEN_CHUNK * TOKEN_CHUNK
    return max(out + _gram_work(n, my, dtype_bytes), 2 * out + _gram_work(n, kx, dtype_bytes), 3 * out)


def _q(lay: MeasureLayout, p: str, role: str) -> float:
    """Peak bytes per element of one error, output included (at least the output and its square)."""
    return max(lay.quant_bytes.get((p, role), 16.0), 8.0)


FORMAT_BLOCKS = {("fp8", "act"): (1, 128), ("fp8", "weight"): (128, 128),
                 ("fp4", "act"): (1, 16), ("fp4", "weight"): (16, 16)}
"""The default formats' scaling blocks (FP8 blockwise, NVFP4) in the GEMM layout, the blocked
(contraction) dim last: activations and gradients, and weights (Formats().spec(p).cast(role).block)."""
CONTRACT_FIRST = ("wgrad_input", "wgrad_grad_output", "dgrad_weight")
"""Roles whose operand contracts over its first dim (the tokens; a weight's output features)."""


def _err_elems(p: str, role: str, rows: int, cols: int) -> int:
    """Elements one error of a [rows, cols] operand quantizes: zero-padded to whole blocks in the
    role's GEMM layout (formats/quantize.py), which is what its peak grows with."""
    br, bc = FORMAT_BLOCKS[(p, "weight" if role.endswith("weight") else "act")]
    if role in CONTRACT_FIRST:
        rows, cols = cols, rows
    return (-(-rows // br) * br) * (-(-cols // bc) * bc)


def _precisions(lay: MeasureLayout) -> list:
    return ["fp8", "fp4"][:lay.precisions] if lay.precisions < 2 else ["fp8", "fp4"]


def _noise_unpack(numel: int, numel_full: int) -> int:
    """noise.NoiseField.chunks: the whole tensor's random words, a block's words (int64 and
    int32) and its +-1 entries (int32, unpacked in place)."""
    chunk = min(numel, NOISE_CHUNK)
    return numel_full // 4 + int(4.375 * chunk)


def _sp(lay: MeasureLayout) -> bool:
    return lay.sp


def _gathered(lay: MeasureLayout, n: int, kx: int, my: int, column: bool) -> int:
    """A hook's gathered operands (n: this rank's tokens): SP's token-sharded one; CP's X and G_Y of
    n x CP rows, and half of one again while its second halves are put in order (gather_cp_rows)."""
    sp = (n * kx if column else n * my) if _sp(lay) else 0
    whole = n * lay.cp
    return lay.act_bytes * (sp + (whole * (kx + my) + whole * max(kx, my) // 2 if lay.cp > 1 else 0))


def clean_hook_phases(lay: MeasureLayout, name: str, tokens: "int | None" = None, first: bool = True) -> dict:
    """Peak bytes of each phase of the clean pass's G_Y hook (collector._on_gy_clean), in its order."""
    (rows_w, cols_w, kx, my), column = lay.linears()[name], lay.column(name)
    n, a = tokens or lay.tokens, lay.act_bytes
    nt = n * lay.cp  # the hook's tokens: the micro-batch's, gathered over CP
    ps = _precisions(lay)
    y_rows = n // lay.tp if (_sp(lay) and not column) else n
    gathered = _gathered(lay, n, kx, my, column)
    phases = {"gy_norm": _norm_temp(y_rows * my, a)}
    numel = y_rows * my
    numel_full = n * my * (lay.tp if column else 1)
    strided = 0
    if lay.halves:  # <z, G_Y> on the first half of the batch dim (collector.forward_noise_part): a
        numel, numel_full = numel // 2, numel_full // 2  # strided view, copied by reshape per chunk
        strided = a * min(numel, NOISE_CHUNK)
    phases["noise"] = _noise_unpack(numel, numel_full) + strided + _copy(min(numel, NOISE_CHUNK), a)
    # the token samples (copies: index_select, or a float32 conversion) and their errors
    nf, nb = _kept(nt, lay.token_stride), _kept(nt, lay.grad_token_stride)
    xs, gs = (4 * nf * kx, 4 * nf * my) if (nf < nt or a != 4) else (0, 0)
    xb, gb = (4 * nb * kx, 4 * nb * my) if (nb < nt or a != 4) else (0, 0)
    ex = 4 * nf * kx
    idx = _index(nf, nt) + _index(nb, nt)  # the samples' row indices
    errors = 0
    for i, p in enumerate(ps):
        before = i * ex
        errors = max(errors, before + _q(lay, p, "fprop_input") * _err_elems(p, "fprop_input", nf, kx),
                     before + ex + 4 * nf * kx,
                     before + ex + max(_q(lay, p, "wgrad_input") * _err_elems(p, "wgrad_input", nb, kx),
                                       _q(lay, p, "dgrad_grad_output") * _err_elems(p, "dgrad_grad_output", nb, my),
                                       _q(lay, p, "wgrad_grad_output") * _err_elems(p, "wgrad_grad_output", nb, my)))
    phases["errors"] = gathered + idx + xs + gs + xb + gb + errors
    # chunk Grams of every token (only with a token sample)
    base = gathered + idx + xs + gs + len(ps) * ex
    phases["grams"] = base + (_grams(nt, kx, my, a) if nf < nt else 0)
    # the weight loop, a block of rows at a time: W block, every precision's error of it, G_W's
    # rows on the sample, then per precision Q(W), dY's columns and their products
    r = _block_rows(rows_w, cols_w, lay.weight_block_elems)
    blocked = r < rows_w
    padded_rows = (r + (-r % BLOCK_ROWS) + BLOCK_ROWS) if blocked else r
    w_blk = 4 * r * cols_w if lay.weight_bytes != 4 else 0
    padded = 4 * padded_rows * cols_w if blocked else 0
    err_each = 4 * padded_rows * cols_w
    making = max(w_blk + padded + i * err_each
                 + _q(lay, p, "fprop_weight") * _err_elems(p, "fprop_weight", padded_rows, cols_w)
                 for i, p in enumerate(ps))
    blk = 4 * r * cols_w
    # dY = addmm(X_s E^T, E_X, (W + E)^T): W + E and two [nf, r] products live at once (addmm
    # writes a new tensor; its input X_s E^T is freed after), then dY and G_Y's columns times it
    using = w_blk + padded + len(ps) * err_each + blk + blk + 2 * 4 * nf * r
    phases["weights"] = base + len(ps) * 4 * nf + max(making, using)
    return phases


def clean_hook_bytes(lay: MeasureLayout, name: str, tokens: "int | None" = None) -> int:
    """Peak working set of the clean pass's G_Y hook of one linear."""
    return int(max(clean_hook_phases(lay, name, tokens).values()))


def bwd_noise_hook_bytes(lay: MeasureLayout, name: str, tokens: "int | None" = None) -> int:
    """Peak working set of the backward-noise pass's G_Y hook (||G_Y^T X||^2 on the sample): the
    chunk Grams, then the sampled rows and a block of G_W with its square."""
    (rows_w, cols_w, kx, my), column = lay.linears()[name], lay.column(name)
    gathered = _gathered(lay, tokens or lay.tokens, kx, my, column)
    n, a = (tokens or lay.tokens) * lay.cp, lay.act_bytes  # the micro-batch's tokens, gathered over CP
    nf = _kept_min(n, lay.token_stride, 2)
    grams = _grams(n, kx, my, a) if nf < n else 0
    samples = 4 * nf * (kx + my) if (nf < n or a != 4) else 0
    r = _block_rows(my, kx, lay.weight_block_elems)
    return int(gathered + _index(nf, n) + max(grams, samples + 2 * 4 * r * kx))


def gx_hook_bytes(lay: MeasureLayout, name: str, tokens: "int | None" = None) -> int:
    """The clean pass's G_X hook: ||G_X||^2, then <G_X, E_X> on the sample."""
    _, _, kx, _ = lay.linears()[name]
    shard = lay.tp if (_sp(lay) and lay.column(name)) else 1
    n = (tokens or lay.tokens) // shard
    nf = _kept((tokens or lay.tokens) * lay.cp, lay.token_stride) // (shard * lay.cp)  # this rank's sampled rows
    sampled = 4 * nf * kx + 4 * nf * kx if lay.first_order else 0
    return int(max(_norm_temp(n * kx, lay.act_bytes), sampled))


def noise_add_bytes(lay: MeasureLayout, name: str) -> int:
    """Forward noise added to Y (or backward noise to G_X): the chunked unpacking and the block's
    conversion, on top of the new tensor that replaces Y (not extra: Y itself is dropped)."""
    _, _, kx, my = lay.linears()[name]
    numel = lay.tokens * my
    full = numel * (lay.tp if lay.column(name) else 1)
    return int(_noise_unpack(numel, full) + lay.act_bytes * min(numel, NOISE_CHUNK))


def held_bytes(lay: MeasureLayout, chunk: "int | None" = None) -> int:
    """Layer inputs the hooks keep per micro-batch in flight on the stage (or one of its chunks;
    see the module docstring); an expert unit's: every local expert's routed rows. The inputs of
    gpt.INPUT_READ_BY_ANOTHER cost nothing of their own (the measured CPU run counts the storage
    once, tests/bench/test_measure_scale.py): MLA's kv down-projection reads the very tensor its
    query projection reads, held for that one; a shared expert's fc1 reads the MoE layer's input,
    which Megatron's router saves for its own backward in a bare frozen pass too
    (moe_utils.RouterGatingLinearFunction saves its input unconditionally)."""
    if lay.recompute == "full":
        return 0
    sp = lay.sequence_parallel and lay.tp > 1
    total = 0
    lin = lay.linears()
    for name, n in lay.copies(chunk).items():
        if name.removeprefix(gpt.MTP) in gpt.INPUT_READ_BY_ANOTHER:
            continue
        kx = lin[name][2]
        if lay.is_expert(name):
            tokens = lay.expert_tokens
        else:  # SP hands a column-parallel linear (and MLA's duplicated down-projections) a token shard
            sharded = lay.column(name) or lay._entries[name].kind is ParallelKind.DUPLICATED
            tokens = lay.tokens // lay.tp if (sp and sharded) else lay.tokens
        total += n * tokens * kx * lay.act_bytes
    return total


def held_peak(lay: MeasureLayout) -> tuple:
    """(bytes, chunk-forwards): the most layer inputs the hooks hold at once on the modelled rank,
    and how many (micro-batch, chunk) forwards wait for their backward then, from `schedule`."""
    if lay.recompute == "full":
        return 0, 0
    explicit = lay.stage is not None or lay.pp == 1
    per = ([held_bytes(lay, c) for c in range(len(lay.stage_chunks()))] if explicit else [held_bytes(lay)])
    live = pending = best = best_n = 0
    for kind, _, c in schedule(lay):
        sign = 1 if kind == "F" else -1
        live, pending = live + sign * per[c], pending + sign
        if live > best or (live == best and pending > best_n):
            best, best_n = live, pending
    return best, best_n


def adam_bytes(lay: MeasureLayout) -> int:
    """Reading AdamW's state of the largest weight shard: float64 blocks, and a float32 copy of
    each moment when they are stored scaled (FP16/FP8). The distributed optimizer shards a dense
    weight over DP x CP, an expert's over the expert-data-parallel group."""
    edp = max(1, lay.tp * lay.dp * lay.cp // (lay.etp * lay.ep))
    mine = _stage_names(lay)
    shards = [math.ceil(r * c / ((edp if lay.is_expert(name) else lay.dp * lay.cp)
                                 if lay.distributed_optimizer else 1))
              for name, (r, c, _, _) in lay.linears().items() if name in mine]
    largest = max(shards) if lay.has_optimizer else 0
    # five float64 blocks live at once in adam.py's loop (v_hat, denom, scale, and the update's
    # two temporaries; the moments themselves are read through views, not copied)
    blocks = 5 * 8 * min(largest, BLOCK_ELEMS)
    return int(blocks + (2 * 4 * largest if lay.moment_bytes == 1 else 0))


def _stage_names(lay: MeasureLayout) -> set:
    """The linears of the modelled stage (stage None at PP > 1: every linear of the model)."""
    if lay.stage is None and lay.pp > 1:
        return set(lay.linears())
    return set(lay.copies())


def persistent_bytes(lay: MeasureLayout) -> int:
    """Two device tables (clean, noise), their reductions' copies, masks and noise scales."""
    rows = len(lay.inventory) + 1
    return rows * FIELDS * (8 * 6 + 2) + rows * 2 * 8


def memory(lay: MeasureLayout) -> dict:
    """Bytes per rank: held (the most layer inputs in flight at once, held_peak), the largest
    transient, and the extra over training and over a bare frozen pass."""
    hooks = {}
    mine = _stage_names(lay)
    for name in (n for n in lay.linears() if n in mine):
        v = lay.view(name)  # an expert unit's hooks run one expert at a time, on its routed rows
        noise_tokens = v.tokens // 2 if lay.halves else v.tokens
        hooks[name] = max(clean_hook_bytes(v, name), bwd_noise_hook_bytes(v, name, noise_tokens),
                          gx_hook_bytes(v, name), noise_add_bytes(v, name))
    transient = max(max(hooks.values()), adam_bytes(lay))
    held, pending = held_peak(lay)
    persistent = persistent_bytes(lay)
    return {"held": held, "held_per_microbatch": held_bytes(lay), "in_flight": pending,
            "hooks": hooks, "adam": adam_bytes(lay), "transient": transient, "persistent": persistent,
            "extra_over_training": transient + persistent, "extra_over_frozen_pass": held + transient + persistent}
