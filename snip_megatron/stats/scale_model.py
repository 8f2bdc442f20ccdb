"""What one measurement costs a rank: extra memory, host syncs and compute, from the layout alone.

A model of the code in stats/ (collector.py, weights.py, tokens.py, noise.py, adam.py), tensor by
tensor, validated against measured peaks on small CPU models (bench/measure_scale.py,
docs/method.md "The measurement at scale"). Pure Python: no torch, nothing allocated.

Memory, per rank, in three parts:
- held: the layer inputs X the clean and backward-noise hooks keep until their backward. A
  frozen pass would drop them (Megatron's frozen-weight linear saves no input), a training step
  keeps them for its wgrad; so they are extra over a bare frozen pass, not over training. Under
  full recompute they live only while a layer is recomputed (not counted; training recomputes the
  same tensors).
- transient: the largest working set of one hook (the token sample, its errors, one block of
  weight rows and its errors, the wgrad and dY blocks, the noise unpacking), the AdamW read, and
  the device accumulators (persistent, a few hundred KB).
- nothing per micro-batch in flight beyond `held`.
The extra over training is transient + persistent: a measurement runs outside the training step,
its passes hold at most the activations a training step holds (frozen weights, at most as many
micro-batches in flight), and nothing survives it.

Compute: the passes run every planned linear in BF16 over K_d sampled micro-batches (clean: forward
+ dgrad, no wgrad; noise: the same), the hooks add G_W and dY on the token sample (GEMMs), and the
quantizers, noise and norms (memory-bound elementwise work); in training-step equivalents of
the layout's own step (all M micro-batches, forward + dgrad + wgrad (+ recompute), linears at the
plan's rate), with the pipeline bubble of each pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from snip_megatron.models import gpt
from snip_megatron.models.inventory import ParallelKind
from snip_megatron.shapes import ModelShape

TOKEN_CHUNK = 16
NOISE_CHUNK = 1 << 22  # noise.CHUNK_ELEMS
BLOCK_ELEMS = 1 << 22  # tokens.BLOCK_ELEMS, adam.BLOCK
WEIGHT_BLOCK_ELEMS = 1 << 22  # weights.MAX_BLOCK_ELEMS
BLOCK_ROWS = 128  # weights.BLOCK_ROWS
FIELDS = 21 + 2 * 10  # table.field_names() with FP8 and FP4

# Peak bytes per input element of one error E = Q(T) - T of a float32 operand (output included),
# by precision and role: measured on the CPU with bench/measure_scale.py --calibrate (NVFP4 and
# FP8 blockwise, the defaults); the bench re-measures them and uses its own figures.
DEFAULT_QUANT_BYTES = {
    ("fp8", "fprop_input"): 16.0, ("fp8", "wgrad_input"): 20.0, ("fp8", "dgrad_grad_output"): 16.0,
    ("fp8", "wgrad_grad_output"): 20.0, ("fp8", "fprop_weight"): 16.0,
    ("fp4", "fprop_input"): 16.0, ("fp4", "wgrad_input"): 28.0, ("fp4", "dgrad_grad_output"): 16.0,
    ("fp4", "wgrad_grad_output"): 28.0, ("fp4", "fprop_weight"): 16.0,
}


@dataclass(frozen=True, kw_only=True)
class GPURates:
    """Dense peak rates (TFLOP/s) and memory bandwidth (TB/s) of the GPU the figures assume."""

    name: str = "H100 SXM"
    bf16: float = 989.0
    fp8: float = 1979.0
    fp4: float = 1979.0  # Hopper has no FP4 GEMMs: FP4 plans run (emulated) no faster than FP8
    hbm_tb_s: float = 3.35
    elementwise_bytes: float = 64.0
    """HBM bytes moved per element a fake quantizer reads (10-20 float32 kernels per element)."""
    streamed_bytes: float = 8.0
    """HBM bytes moved per activation element a norm, noise or gather pass reads or writes."""


@dataclass(frozen=True, kw_only=True)
class MeasureLayout:
    """A rank's layout and the measurement's settings."""

    shape: ModelShape
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    """"none", "selective" (attention core) or "full" (every layer)."""
    micro_batch_size: int = 1
    seq_length: int = 0
    """0: the shape's."""
    global_batch: int = 1
    """Sequences per step over all replicas."""
    micro_batches: "int | None" = 8
    """MeasureConfig.micro_batches (None: all)."""
    token_stride: int = 4
    grad_token_stride: int = 8
    precisions: int = 2
    act_bytes: int = 2
    """Bytes per activation element (2: BF16; 4: the FP32 CPU models)."""
    weight_bytes: int = 2
    moment_bytes: int = 4
    """Bytes per stored AdamW moment (4: FP32; 2 or 1: --use-precision-aware-optimizer, then
    dequantized to a float32 copy, see adam.py)."""
    distributed_optimizer: bool = True
    first_order: bool = True
    plan_rate: str = "fp8"
    """The training step's linears run at this rate (the initial all-FP8 plan)."""
    quant_bytes: dict = field(default_factory=lambda: dict(DEFAULT_QUANT_BYTES))
    weight_block_elems: int = WEIGHT_BLOCK_ELEMS
    """weights.MAX_BLOCK_ELEMS (the validation lowers it to make small models block)."""

    def __post_init__(self):
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"MeasureLayout.recompute must be none, selective or full, got {self.recompute!r}")
        if self.global_batch % (self.micro_batch_size * self.dp):
            raise ValueError("MeasureLayout.global_batch must be a multiple of micro_batch_size * dp")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        return self.seq_length or self.shape.seq_length

    @property
    def num_microbatches(self) -> int:
        """M: micro-batches per replica per step."""
        return self.global_batch // (self.micro_batch_size * self.dp)

    @property
    def measured(self) -> int:
        """K_d: micro-batches the busiest replica measures."""
        total = self.num_microbatches * self.dp
        k = total if not self.micro_batches or self.micro_batches >= total else self.micro_batches
        return math.ceil(k / self.dp)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch in a TP group (CP splits the sequence)."""
        return self.micro_batch_size * self.seq // self.cp

    @property
    def layers(self) -> int:
        return self.shape.num_layers // self.pp

    def column(self, name: str) -> bool:
        """Whether TP shards the output dim of a layer's linear `name`."""
        return self._kinds()[name] is ParallelKind.COLUMN

    def _kinds(self) -> dict:
        return {e.key.name: e.kind for e in gpt.inventory(self.shape.with_(num_layers=1))}

    def linears(self) -> dict:
        """name -> (weight rows, weight cols, X features, G_Y features) on this rank."""
        out = {}
        for e in gpt.inventory(self.shape.with_(num_layers=1)):
            name, (m, k) = e.key.name, e.shape
            if e.kind is ParallelKind.COLUMN:
                out[name] = (m // self.tp, k, k, m // self.tp)
            else:
                out[name] = (m, k // self.tp, k // self.tp, m)
        return out


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


def _q(lay: MeasureLayout, p: str, role: str) -> float:
    """Peak bytes per element of one error, output included (at least the output and its square)."""
    return max(lay.quant_bytes.get((p, role), 16.0), 8.0)


def _precisions(lay: MeasureLayout) -> list:
    return ["fp8", "fp4"][:lay.precisions] if lay.precisions < 2 else ["fp8", "fp4"]


def _noise_unpack(numel: int, numel_full: int) -> int:
    """noise.NoiseField.chunks: the whole tensor's random words, a block's words (int64 and
    int32) and its +-1 entries (int32, unpacked in place)."""
    chunk = min(numel, NOISE_CHUNK)
    return numel_full // 4 + int(4.375 * chunk)


def _sp(lay: MeasureLayout) -> bool:
    return lay.sequence_parallel and lay.tp > 1


def clean_hook_phases(lay: MeasureLayout, name: str, tokens: "int | None" = None, first: bool = True) -> dict:
    """Peak bytes of each phase of the clean pass's G_Y hook (collector._on_gy_clean), in its order."""
    rows_w, cols_w, kx, my = lay.linears()[name]
    column = lay.column(name)
    n = tokens or lay.tokens
    a = lay.act_bytes
    ps = _precisions(lay)
    y_rows = n // lay.tp if (_sp(lay) and not column) else n
    gathered = (n * kx * a if column else n * my * a) if _sp(lay) else 0
    phases = {"gy_norm": _norm_temp(y_rows * my, a)}
    numel = y_rows * my
    numel_full = n * my * (lay.tp if column else 1)
    phases["noise"] = _noise_unpack(numel, numel_full) + _copy(min(numel, NOISE_CHUNK), a)
    # the token samples (copies: index_select, or a float32 conversion) and their errors
    nf, nb = _kept(n, lay.token_stride), _kept(n, lay.grad_token_stride)
    xs, gs = (4 * nf * kx, 4 * nf * my) if (nf < n or a != 4) else (0, 0)
    xb, gb = (4 * nb * kx, 4 * nb * my) if (nb < n or a != 4) else (0, 0)
    ex = 4 * nf * kx
    errors = 0
    for i, p in enumerate(ps):
        before = i * ex
        errors = max(errors, before + _q(lay, p, "fprop_input") * nf * kx, before + ex + 4 * nf * kx,
                     before + ex + max(_q(lay, p, "wgrad_input") * nb * kx, _q(lay, p, "dgrad_grad_output") * nb * my,
                                       _q(lay, p, "wgrad_grad_output") * nb * my))
    phases["errors"] = gathered + xs + gs + xb + gb + errors
    # chunk Grams of every token (only with a token sample)
    base = gathered + xs + gs + len(ps) * ex
    chunks = -(-n // TOKEN_CHUNK)
    grams = 3 * chunks * TOKEN_CHUNK * TOKEN_CHUNK * 4 + _copy(min(n * max(kx, my), BLOCK_ELEMS), a)
    phases["grams"] = base + (grams if nf < n else 0)
    # the weight loop, a block of rows at a time: W block, every precision's error of it, G_W's
    # rows on the sample, then per precision Q(W), dY's columns and their products
    r = _block_rows(rows_w, cols_w, lay.weight_block_elems)
    blocked = r < rows_w
    padded_rows = (r + (-r % BLOCK_ROWS) + BLOCK_ROWS) if blocked else r
    w_blk = 4 * r * cols_w if lay.weight_bytes != 4 else 0
    padded = 4 * padded_rows * cols_w if blocked else 0
    err_each = 4 * padded_rows * cols_w
    making = max(w_blk + padded + i * err_each + _q(lay, p, "fprop_weight") * padded_rows * cols_w
                 for i, p in enumerate(ps))
    blk = 4 * r * cols_w
    using = w_blk + padded + len(ps) * err_each + blk + max(blk, blk + 3 * 4 * nf * r)
    phases["weights"] = base + len(ps) * 4 * nf + max(making, using)
    return phases


def clean_hook_bytes(lay: MeasureLayout, name: str, tokens: "int | None" = None) -> int:
    """Peak working set of the clean pass's G_Y hook of one linear."""
    return int(max(clean_hook_phases(lay, name, tokens).values()))


def bwd_noise_hook_bytes(lay: MeasureLayout, name: str, tokens: "int | None" = None) -> int:
    """Peak working set of the backward-noise pass's G_Y hook (||G_Y^T X||^2 on the sample): the
    chunk Grams, then the sampled rows and a block of G_W with its square."""
    rows_w, cols_w, kx, my = lay.linears()[name]
    column = lay.column(name)
    n, a = tokens or lay.tokens, lay.act_bytes
    gathered = (n * kx * a if column else n * my * a) if _sp(lay) else 0
    nf = _kept(n, lay.token_stride) if n >= 2 * lay.token_stride * TOKEN_CHUNK else n
    chunks = -(-n // TOKEN_CHUNK)
    grams = (3 * chunks * TOKEN_CHUNK * TOKEN_CHUNK * 4 + _copy(min(n * max(kx, my), BLOCK_ELEMS), a)) if nf < n else 0
    samples = 4 * nf * (kx + my) if (nf < n or a != 4) else 0
    r = _block_rows(my, kx, lay.weight_block_elems)
    return int(gathered + max(grams, samples + 2 * 4 * r * kx))


def gx_hook_bytes(lay: MeasureLayout, name: str, tokens: "int | None" = None) -> int:
    """The clean pass's G_X hook: ||G_X||^2, then <G_X, E_X> on the sample."""
    _, _, kx, _ = lay.linears()[name]
    shard = lay.tp if (_sp(lay) and lay.column(name)) else 1
    n = (tokens or lay.tokens) // shard
    nf = _kept(tokens or lay.tokens, lay.token_stride) // shard
    sampled = 4 * nf * kx + 4 * nf * kx if lay.first_order else 0
    return int(max(_norm_temp(n * kx, lay.act_bytes), sampled))


def noise_add_bytes(lay: MeasureLayout, name: str) -> int:
    """Forward noise added to Y (or backward noise to G_X): the chunked unpacking and the block's
    conversion, on top of the new tensor that replaces Y (not extra: Y itself is dropped)."""
    _, _, kx, my = lay.linears()[name]
    numel = lay.tokens * my
    full = numel * (lay.tp if lay.column(name) else 1)
    return int(_noise_unpack(numel, full) + lay.act_bytes * min(numel, NOISE_CHUNK))


def held_bytes(lay: MeasureLayout) -> int:
    """Layer inputs the hooks keep per micro-batch in flight (see the module docstring)."""
    if lay.recompute == "full":
        return 0
    sp = lay.sequence_parallel and lay.tp > 1
    total = 0
    for name, (_, _, kx, _) in lay.linears().items():
        tokens = lay.tokens // lay.tp if (sp and lay.column(name)) else lay.tokens
        total += tokens * kx * lay.act_bytes
    return total * lay.layers


def in_flight(lay: MeasureLayout) -> int:
    """Micro-batches whose backward is pending on the first stage (1F1B warm-up + 1)."""
    return min(lay.measured, lay.pp)


def adam_bytes(lay: MeasureLayout) -> int:
    """Reading AdamW's state of the largest weight shard: float64 blocks, and a float32 copy of
    each moment when they are stored scaled (FP16/FP8)."""
    largest = max(r * c for r, c, _, _ in lay.linears().values())
    if lay.distributed_optimizer:
        largest = math.ceil(largest / (lay.dp * lay.cp))
    # five float64 blocks live at once in adam.py's loop (v_hat, denom, scale, and the update's
    # two temporaries; the moments themselves are read through views, not copied)
    blocks = 5 * 8 * min(largest, BLOCK_ELEMS)
    return int(blocks + (2 * 4 * largest if lay.moment_bytes == 1 else 0))


def persistent_bytes(lay: MeasureLayout) -> int:
    """Two device tables (clean, noise), their reductions' copies, masks and noise scales."""
    rows = len(gpt.inventory(lay.shape)) + 1
    return rows * FIELDS * (8 * 6 + 2) + rows * 2 * 8


def memory(lay: MeasureLayout) -> dict:
    """Bytes per rank: held (per micro-batch in flight, x in_flight), the largest transient, and
    the extra over training and over a bare frozen pass."""
    hooks = {}
    noise_tokens = lay.tokens // 2 if lay.measured == 1 and lay.micro_batch_size % 2 == 0 else lay.tokens
    for name in lay.linears():
        hooks[name] = max(clean_hook_bytes(lay, name), bwd_noise_hook_bytes(lay, name, noise_tokens),
                          gx_hook_bytes(lay, name), noise_add_bytes(lay, name))
    transient = max(max(hooks.values()), adam_bytes(lay))
    held = held_bytes(lay) * in_flight(lay)
    persistent = persistent_bytes(lay)
    return {"held": held, "held_per_microbatch": held_bytes(lay), "in_flight": in_flight(lay),
            "hooks": hooks, "adam": adam_bytes(lay), "transient": transient, "persistent": persistent,
            "extra_over_training": transient + persistent, "extra_over_frozen_pass": held + transient + persistent}


def host_syncs(lay: MeasureLayout) -> dict:
    """Host syncs per rank per measurement (the code's own; Megatron's schedule adds what it adds
    to a training step). The statistics reach the host once; the host-side parts of the tables
    and masks go to the device in a few small blocking copies."""
    return {"device_to_host": 1, "host_to_device": 5}


def flops(lay: MeasureLayout, rates: GPURates = GPURates()) -> dict:
    """Extra compute of one measurement in training-step equivalents of this layout."""
    lin = lay.linears()
    n = lay.tokens
    params = sum(r * c for r, c, _, _ in lin.values()) * lay.layers  # planned-linear weights on the rank
    fwd_lin = 2 * n * params  # one micro-batch's forward GEMMs
    # attention core (QK^T and AV, causal: half), per micro-batch on the rank, BF16 always
    heads_dim = lay.shape.num_attention_heads * lay.shape.head_dim // lay.tp
    fwd_attn = 2 * 2 * n * (lay.seq // lay.cp) * heads_dim * lay.layers * 0.5
    recompute_fwd = {"none": 0.0, "selective": 0.0, "full": 1.0}[lay.recompute]
    attn_recompute = 1.0 if lay.recompute in ("selective", "full") else 0.0
    m, kd = lay.num_microbatches, lay.measured
    rate = {"bf16": rates.bf16, "fp8": rates.fp8, "fp4": rates.fp4}[lay.plan_rate] * 1e12
    bf16 = rates.bf16 * 1e12
    # a training step: forward, dgrad, wgrad (+ the recomputed forward), over M micro-batches
    step_s = m * ((3 + recompute_fwd) * fwd_lin / rate + (3 + attn_recompute) * fwd_attn / bf16)
    step_s *= (m + lay.pp - 1) / m  # the pipeline bubble
    # one pass (clean or noise): forward + dgrad in BF16 (frozen weights: no wgrad) per measured mb
    pass_gemm = kd * ((2 + recompute_fwd) * fwd_lin + (3 + attn_recompute) * fwd_attn)
    # hooks: G_W on the sample (clean: every mb; noise: the backward-noise half), dY (2 GEMMs per
    # precision), chunk Grams
    nf = _kept(n, lay.token_stride)
    sample_lin = 2 * nf * params
    hook_gemm = kd * (sample_lin * (1 + 0.5 + 2 * lay.precisions)
                      + 2 * 2 * n * TOKEN_CHUNK * sum(kx + my for _, _, kx, my in lin.values()) * lay.layers)
    # elementwise: quantizers (weights each measured mb, the sampled activations), noise, norms
    nb = _kept(n, lay.grad_token_stride)
    quantized = params * lay.precisions + lay.precisions * lay.layers * sum(
        nf * kx + nb * (kx + 2 * my) for _, _, kx, my in lin.values())
    streamed = 6 * n * lay.layers * sum(kx + my for _, _, kx, my in lin.values())  # norms, noise (x2), gathers
    elementwise_s = kd * (quantized * rates.elementwise_bytes + streamed * rates.streamed_bytes) / (rates.hbm_tb_s * 1e12)
    bubble = (kd + lay.pp - 1) / kd
    measure_s = (2 * pass_gemm + hook_gemm) / bf16 * bubble + elementwise_s
    return {"step_s": step_s, "measure_s": measure_s, "step_equiv": measure_s / step_s,
            "measure_flops": 2 * pass_gemm + hook_gemm, "elementwise_s": elementwise_s,
            "measured_microbatches": kd, "microbatches": m}
