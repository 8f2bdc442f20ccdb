"""What one measurement costs a rank: extra memory, host syncs and compute, from the layout alone.

A model of the code in stats/ (collector.py, weights.py, tokens.py, noise.py, adam.py), tensor by
tensor, validated against measured peaks on small CPU models (bench/measure_scale.py,
docs/method.md "The measurement at scale"). Pure Python: no torch, nothing allocated. The layout
and its pipeline geometry are scale_layout.py's, the byte formulas scale_bytes.py's; this module
adds the host syncs and the compute, and names all of them.

Memory, per rank, in three parts:
- held: the layer inputs X the clean and backward-noise hooks keep until their backward. A
  frozen pass would drop them (Megatron's frozen-weight linear saves no input), a training step
  keeps them for its wgrad; so they are extra over a bare frozen pass, not over training (an input
  two linears share, or that Megatron holds anyway, counts once or not: models.gpt.INPUT_READ_BY_ANOTHER). Under
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

from dataclasses import dataclass

# The layout (scale_layout.py) and the byte formulas (scale_bytes.py) live in their own files; the
# names its callers (bench/measure_scale.py, tests/stats/test_scale_model.py) use are this module's too.
from snip_megatron.stats.scale_bytes import (  # noqa: F401
    BLOCK_ELEMS, BLOCK_ROWS, FIELDS, NOISE_CHUNK, TOKEN_CHUNK, _block_rows, _gathered, _kept, _kept_min, adam_bytes,
    bwd_noise_hook_bytes, clean_hook_bytes, clean_hook_phases, gx_hook_bytes, held_bytes, held_peak, memory,
    persistent_bytes,
)
from snip_megatron.stats.scale_layout import (  # noqa: F401
    DEFAULT_QUANT_BYTES, DISPATCHER_SYNCS, WEIGHT_BLOCK_ELEMS, MeasureLayout, schedule,
)


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


def host_syncs(lay: MeasureLayout) -> dict:
    """SNIP's own host syncs per rank per measurement, read off stats/measure.py and reduce.py
    (Megatron's schedule adds what it adds to a training step; its token dispatcher's syncs are
    `dispatcher_syncs`). Every statistic stays on the device; then:
    - device-to-host: the reduced table, once; with more than one process, the flag each rank
      all-reduces after setup and after the noise pass (`agree_on_failure`, filled on the device); with
      routed experts, the boolean mask that picks the summed fields of their rows, once per table
      reduced (`reduce_experts_tensor`, clean and noise);
    - blocking host-to-device copies: the TP, CP and summed-field masks, the host part of each
      pass's table, the rows of the noise scales; with routed experts their mask, their row index (per table, in `finish` and in
      `reduce_experts_tensor`) and, on EP ranks > 0, the replicated fields' columns; with AdamW's
      state sharded over DP (and CP), the list of its columns indexed on the clean table.
    The optimizer's terms are read off the code only; the others are counted on CPU runs by
    bench/measure_scale.py (HostSyncs)."""
    experts = lay.moe is not None
    multi = lay.world > 1
    d2h = 1 + (2 if multi else 0) + (2 if experts else 0)
    h2d = 3 + 2 + 1
    if experts:
        h2d += 1 + 2 * 2 + (2 if lay.ep > 1 else 0)
    if lay.has_optimizer and lay.distributed_optimizer:  # adam_dp_sharded: list indices on the clean table
        h2d += (lay.dp > 1) + (lay.cp > 1) + experts
    return {"device_to_host": d2h, "host_to_device": int(h2d)}


def measurement_passes(lay: MeasureLayout) -> int:
    """Passes over the measured micro-batches: the clean one, then one noise pass over alternate
    micro-batches when the step's sample has two or more and no expert group spans data-parallel
    replicas, else a forward- and a backward-noise pass (a dense model's lone micro-batch split
    into halves: one); measure.py's `interleave`."""
    k_total = lay.measured_total  # the step's whole sample
    return 2 if (k_total >= 2 and not lay.spans) or lay.halves else 3


def dispatcher_syncs(lay: MeasureLayout) -> int:
    """Megatron's own host syncs in the measurement's passes: its dropless token dispatcher's
    (DISPATCHER_SYNCS per MoE layer forward) on every MoE layer of the stage, an MoE MTP layer's
    included, in each pass over the K_d measured micro-batches, as every training micro-batch
    has them too. The flex dispatcher is not modelled."""
    if lay.moe is None:
        return 0
    moe = lay.stage_layers()["moe"] if lay.stage is None and lay.pp > 1 else lay.moe_layers()
    return measurement_passes(lay) * lay.measured * moe * DISPATCHER_SYNCS[lay.dispatcher]


def flops(lay: MeasureLayout, rates: GPURates = GPURates()) -> dict:
    """Extra compute of one measurement in training-step equivalents of this layout (the modelled
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
    v = lay.vpp or 1  # the interleaved schedule's bubble is 1 / vpp of the plain one's
    step_s *= (m + (lay.pp - 1) / v) / m  # the pipeline bubble
    # one pass (clean or noise): forward + dgrad in BF16 (frozen weights: no wgrad) per measured mb
    pass_gemm = kd * ((2 + recompute_fwd) * fwd_lin + (3 + attn_recompute) * fwd_attn)
    # hooks: G_W on the sample (clean: every mb; noise: the backward-noise ones), dY (2 GEMMs per
    # precision), chunk Grams
    sample_lin = 2 * sum(_kept(hook[name], lay.token_stride) * lin[name][0] * lin[name][1] * c
                         for name, c in copies.items())
    grams = 2 * 2 * TOKEN_CHUNK * sum(hook[name] * (lin[name][2] + lin[name][3]) * c for name, c in copies.items())
    noise_share = 0.5 if measurement_passes(lay) == 2 else 1.0  # interleaved: half the mbs backward-noise
    hook_gemm = kd * (sample_lin * (1 + noise_share + 2 * lay.precisions) + grams)
    # elementwise: quantizers (weights each measured mb, the sampled activations), noise, norms
    quantized = params * lay.precisions + lay.precisions * sum(
        c * (_kept(hook[name], lay.token_stride) * lin[name][2]
             + _kept(hook[name], lay.grad_token_stride) * (lin[name][2] + 2 * lin[name][3]))
        for name, c in copies.items())
    streamed = sum((6 * tokens[name] + 2 * (hook[name] - tokens[name])) * c * (lin[name][2] + lin[name][3])
                   for name, c in copies.items())  # norms, noise (x2), gathers (CP's: written and read)
    elementwise_s = kd * (quantized * rates.elementwise_bytes + streamed * rates.streamed_bytes) / (rates.hbm_tb_s * 1e12)
    bubble = (kd + (lay.pp - 1) / v) / kd
    passes = measurement_passes(lay)  # the clean pass and one or two noise passes, each over K_d
    measure_s = (passes * pass_gemm + hook_gemm) / bf16 * bubble + elementwise_s
    return {"step_s": step_s, "measure_s": measure_s, "step_equiv": measure_s / step_s,
            "measure_flops": passes * pass_gemm + hook_gemm, "elementwise_s": elementwise_s,
            "measured_microbatches": kd, "microbatches": m}
