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
Under CP the hooks work on the micro-batch's tokens, X and G_Y gathered over CP (token_layout.py).
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

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

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
    mla: "gpt.MLADims | None" = None
    """Multi-latent attention's widths (None: grouped-query attention)."""
    moe: "gpt.MoEDims | None" = None
    """The MoE layers' experts (None: a dense model)."""
    ep: int = 1
    """Expert-parallel size: each rank holds num_experts / ep experts of every MoE layer."""
    etp: int = 1
    """Expert tensor-parallel size (shards one expert's linears as TP shards a dense one's)."""
    expert_imbalance: float = 1.0
    """Routed rows of the busiest local expert over the balanced share (1.0: balanced routing)."""

    def __post_init__(self):
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"MeasureLayout.recompute must be none, selective or full, got {self.recompute!r}")
        if self.global_batch % (self.micro_batch_size * self.dp):
            raise ValueError("MeasureLayout.global_batch must be a multiple of micro_batch_size * dp")
        if self.moe is not None and self.moe.num_experts % self.ep:
            raise ValueError(f"MeasureLayout.ep={self.ep} must divide the {self.moe.num_experts} experts")
        if self.moe is not None and (self.tp * self.dp * self.cp) % (self.etp * self.ep):
            raise ValueError(f"MeasureLayout: etp x ep = {self.etp * self.ep} must divide tp x dp x cp = "
                             f"{self.tp * self.dp * self.cp} (Megatron's expert groups fold the dense ones)")

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
        """Layers of the busiest pipeline stage."""
        return math.ceil(self.shape.num_layers / self.pp)

    @cached_property
    def inventory(self):
        """The planned units of the whole model (models.gpt.inventory)."""
        return gpt.inventory(self.shape, mla=self.mla, moe=self.moe)

    @cached_property
    def _entries(self) -> dict:
        """name -> the inventory entry of that linear (one layer's; every layer of a kind alike)."""
        return {e.key.name: e for e in self.inventory}

    def column(self, name: str) -> bool:
        """Whether TP shards the output dim of a layer's linear `name`."""
        return self._entries[name].kind is ParallelKind.COLUMN

    def is_expert(self, name: str) -> bool:
        """Whether `name` is an MoE layer's routed-expert unit (its entry has one expert's shape)."""
        return self._entries[name].experts > 0

    def linears(self) -> dict:
        """name -> (weight rows, weight cols, X features, G_Y features) on this rank, for one expert of
        an expert unit (ETP shards it; TP every other linear)."""
        out = {}
        for name, e in self._entries.items():
            (m, k), tp = e.shape, self.etp if e.experts else self.tp
            if e.kind is ParallelKind.COLUMN:
                out[name] = (m // tp, k, k, m // tp)
            elif e.kind is ParallelKind.ROW:
                out[name] = (m, k // tp, k // tp, m)
            else:  # duplicated over TP (MLA's down-projections)
                out[name] = (m, k, k, m)
        return out

    @property
    def local_experts(self) -> int:
        return self.moe.num_experts // self.ep if self.moe is not None else 0

    @property
    def expert_tokens(self) -> int:
        """Routed rows one local expert gets from one micro-batch: every rank of the EP group
        dispatches its tokens (SP-sharded over TP) x top-k over all experts, and ETP gathers them."""
        if self.moe is None:
            return 0
        local = self.tokens // self.tp if _sp(self) else self.tokens
        return math.ceil(local * self.moe.topk * self.ep * self.etp / self.moe.num_experts * self.expert_imbalance)

    def view(self, name: str) -> "MeasureLayout":
        """The layout a hook of linear `name` sees: itself, or for an expert unit one expert's GEMM
        (its routed rows as one sequence, ETP as the TP, no sequence-parallel gather)."""
        if not self.is_expert(name):
            return self
        return dataclasses.replace(self, tp=self.etp, sequence_parallel=False, cp=1, dp=1, micro_batch_size=1,
                                   global_batch=1, seq_length=self.expert_tokens, ep=1, etp=self.etp)

    def stage_layers(self) -> dict:
        """Layers of each kind on the busiest stage: as many MoE layers as fit (an upper bound)."""
        layers = self.shape.num_layers
        moe_layers = sum(self.moe.is_moe_layer(i, layers) for i in range(1, layers + 1)) if self.moe is not None else 0
        moe = min(self.layers, moe_layers)
        return {"moe": moe, "dense": self.layers - moe}

    def layer_names(self, kind: str) -> list:
        """The linears of one layer of `kind` ("moe" or "dense")."""
        if kind == "dense":
            return [s.name for s in gpt.layer_slots(self.mla, None)]
        return [s.name for s in gpt.layer_slots(self.mla, self.moe)]

    def copies(self) -> dict:
        """name -> how many GEMMs of that linear run per micro-batch on the busiest stage (layers x
        local experts for an expert unit)."""
        out = {}
        for kind, n in self.stage_layers().items():
            for name in self.layer_names(kind) if n else ():
                out[name] = out.get(name, 0) + n * (self.local_experts if self.is_expert(name) else 1)
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
    phases["noise"] = _noise_unpack(numel, numel_full) + _copy(min(numel, NOISE_CHUNK), a)
    # the token samples (copies: index_select, or a float32 conversion) and their errors
    nf, nb = _kept(nt, lay.token_stride), _kept(nt, lay.grad_token_stride)
    xs, gs = (4 * nf * kx, 4 * nf * my) if (nf < nt or a != 4) else (0, 0)
    xb, gb = (4 * nb * kx, 4 * nb * my) if (nb < nt or a != 4) else (0, 0)
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
    chunks = -(-nt // TOKEN_CHUNK)
    grams = 3 * chunks * TOKEN_CHUNK * TOKEN_CHUNK * 4 + _copy(min(nt * max(kx, my), BLOCK_ELEMS), a)
    phases["grams"] = base + (grams if nf < nt else 0)
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
    (rows_w, cols_w, kx, my), column = lay.linears()[name], lay.column(name)
    gathered = _gathered(lay, tokens or lay.tokens, kx, my, column)
    n, a = (tokens or lay.tokens) * lay.cp, lay.act_bytes  # the micro-batch's tokens, gathered over CP
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


def held_bytes(lay: MeasureLayout) -> int:
    """Layer inputs the hooks keep per micro-batch in flight (see the module docstring); an expert
    unit's: every local expert's routed rows."""
    if lay.recompute == "full":
        return 0
    sp = lay.sequence_parallel and lay.tp > 1
    total = 0
    lin = lay.linears()
    for name, n in lay.copies().items():
        kx = lin[name][2]
        if lay.is_expert(name):
            tokens = lay.expert_tokens
        else:  # SP hands a column-parallel linear (and MLA's duplicated down-projections) a token shard
            sharded = lay.column(name) or lay._entries[name].kind is ParallelKind.DUPLICATED
            tokens = lay.tokens // lay.tp if (sp and sharded) else lay.tokens
        total += n * tokens * kx * lay.act_bytes
    return total


def in_flight(lay: MeasureLayout) -> int:
    """Micro-batches whose backward is pending on the first stage (1F1B warm-up + 1)."""
    return min(lay.measured, lay.pp)


def adam_bytes(lay: MeasureLayout) -> int:
    """Reading AdamW's state of the largest weight shard: float64 blocks, and a float32 copy of
    each moment when they are stored scaled (FP16/FP8). The distributed optimizer shards a dense
    weight over DP x CP, an expert's over the expert-data-parallel group."""
    edp = max(1, lay.tp * lay.dp * lay.cp // (lay.etp * lay.ep))
    shards = [math.ceil(r * c / ((edp if lay.is_expert(name) else lay.dp * lay.cp)
                                 if lay.distributed_optimizer else 1))
              for name, (r, c, _, _) in lay.linears().items()]
    largest = max(shards)
    # five float64 blocks live at once in adam.py's loop (v_hat, denom, scale, and the update's
    # two temporaries; the moments themselves are read through views, not copied)
    blocks = 5 * 8 * min(largest, BLOCK_ELEMS)
    return int(blocks + (2 * 4 * largest if lay.moment_bytes == 1 else 0))


def persistent_bytes(lay: MeasureLayout) -> int:
    """Two device tables (clean, noise), their reductions' copies, masks and noise scales."""
    rows = len(lay.inventory) + 1
    return rows * FIELDS * (8 * 6 + 2) + rows * 2 * 8


def memory(lay: MeasureLayout) -> dict:
    """Bytes per rank: held (per micro-batch in flight, x in_flight), the largest transient, and
    the extra over training and over a bare frozen pass."""
    hooks = {}
    # a lone measured micro-batch's noise pass runs on its halves (an MoE model keeps it whole)
    halves = lay.measured == 1 and lay.micro_batch_size % 2 == 0 and lay.moe is None
    for name in lay.linears():
        v = lay.view(name)  # an expert unit's hooks run one expert at a time, on its routed rows
        noise_tokens = v.tokens // 2 if halves else v.tokens
        hooks[name] = max(clean_hook_bytes(v, name), bwd_noise_hook_bytes(v, name, noise_tokens),
                          gx_hook_bytes(v, name), noise_add_bytes(v, name))
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


def measurement_passes(lay: MeasureLayout) -> int:
    """Passes over the measured micro-batches: the clean one, then one noise pass over alternate
    micro-batches when the step's sample has two or more, else a forward- and a backward-noise pass
    (a dense model's lone micro-batch split into halves: one)."""
    total = lay.num_microbatches * lay.dp
    k_total = min(lay.micro_batches, total) if lay.micro_batches else total  # the step's whole sample
    halves = k_total == 1 and lay.micro_batch_size % 2 == 0 and lay.moe is None
    return 2 if k_total >= 2 or halves else 3


def dispatcher_syncs(lay: MeasureLayout) -> int:
    """Megatron's own host syncs in the measurement's passes: the alltoall token dispatcher reads its
    split sizes on the host once per MoE layer forward when EP or TP > 1 (dropless,
    `cuda_sync_point` "before_ep_alltoall"), as every training micro-batch does too."""
    if lay.moe is None or (lay.ep == 1 and lay.tp == 1):
        return 0
    return measurement_passes(lay) * lay.measured * lay.stage_layers()["moe"]


def flops(lay: MeasureLayout, rates: GPURates = GPURates()) -> dict:
    """Extra compute of one measurement in training-step equivalents of this layout (the busiest
    stage; an expert unit counts its local experts' GEMMs on their routed rows)."""
    lin = lay.linears()
    copies = lay.copies()
    n = lay.tokens
    tokens = {name: lay.expert_tokens if lay.is_expert(name) else n for name in copies}
    hook = {name: t if lay.is_expert(name) else t * lay.cp for name, t in tokens.items()}  # gathered over CP
    params = sum(lin[name][0] * lin[name][1] * c for name, c in copies.items())  # planned-linear weights on the rank
    fwd_lin = 2 * sum(tokens[name] * lin[name][0] * lin[name][1] * c for name, c in copies.items())  # one mb's forward GEMMs
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
    sample_lin = 2 * sum(_kept(hook[name], lay.token_stride) * lin[name][0] * lin[name][1] * c
                         for name, c in copies.items())
    grams = 2 * 2 * TOKEN_CHUNK * sum(hook[name] * (lin[name][2] + lin[name][3]) * c for name, c in copies.items())
    hook_gemm = kd * (sample_lin * (1 + 0.5 + 2 * lay.precisions) + grams)
    # elementwise: quantizers (weights each measured mb, the sampled activations), noise, norms
    quantized = params * lay.precisions + lay.precisions * sum(
        c * (_kept(hook[name], lay.token_stride) * lin[name][2]
             + _kept(hook[name], lay.grad_token_stride) * (lin[name][2] + 2 * lin[name][3]))
        for name, c in copies.items())
    streamed = sum((6 * tokens[name] + 2 * (hook[name] - tokens[name])) * c * (lin[name][2] + lin[name][3])
                   for name, c in copies.items())  # norms, noise (x2), gathers (CP's: written and read)
    elementwise_s = kd * (quantized * rates.elementwise_bytes + streamed * rates.streamed_bytes) / (rates.hbm_tb_s * 1e12)
    bubble = (kd + lay.pp - 1) / kd
    measure_s = (2 * pass_gemm + hook_gemm) / bf16 * bubble + elementwise_s
    return {"step_s": step_s, "measure_s": measure_s, "step_equiv": measure_s / step_s,
            "measure_flops": 2 * pass_gemm + hook_gemm, "elementwise_s": elementwise_s,
            "measured_microbatches": kd, "microbatches": m}
