"""One measurement: the statistics pass and the two noise passes through Megatron's schedule
(by default the noise passes share one pass: forward noise on even micro-batches, backward noise
on odd ones; MeasureConfig.interleave_noise).

    table = measure_chunks(model_chunks, forward_step_func, batches, optimizer=optimizer,
                           seq_length=S, micro_batch_size=B)  # a reduced StatsTable on global rank 0
    table = measure_step(ctx, snip_config.measure_config())  # from a loop's StepContext (the controller)

Call it at a step boundary with the micro-batches of the coming step (the caller then trains on
the same list, so the data position does not move). Training is left untouched: parameters are
frozen during the passes (no gradient reaches param.grad or DDP's main_grad buffers), Megatron's
finalize_model_grads is switched off, planned linears run in BF16 and get their precision back,
and the global and Megatron RNG states are restored (noise and stochastic rounding use dedicated
generators).
"""

from __future__ import annotations

import contextlib

import torch

from snip_megatron.formats.precision import Precision
from snip_megatron.stats import adam
from snip_megatron.stats.collector import Collector
from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.discover import planned_linears
from snip_megatron.stats.quant_error import ErrorFn, formats_error_fn
from snip_megatron.stats.reduce import gather_pp, reduce_tp_dp
from snip_megatron.stats.table import StatsTable

NOISE_FIELDS = ("fwd_zg_noisy", "fwd_z_sq", "bwd_dgw_sq", "bwd_eta_sq")


# -- keeping training untouched ----------------------------------------------------------------
def _rng_snapshot():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _rng_restore(snap) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu, cuda, tracker = snap
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    get_cuda_rng_tracker().set_states(tracker)


def _set_precision(module, precision) -> None:
    if hasattr(module, "set_precision"):
        module.set_precision(precision)
    else:
        module.precision = precision


@contextlib.contextmanager
def measurement_mode(model_chunks, linears, config):
    """Parameters frozen, planned linears in BF16, no gradient finalisation; all undone after."""
    params = [p for c in model_chunks for p in c.parameters()]
    requires = [p.requires_grad for p in params]
    precisions = [(m, m.precision, getattr(m, "format_spec", None)) for _, m in linears
                  if hasattr(m, "precision")]
    saved_finalize = getattr(config, "finalize_model_grads_func", None)
    try:
        for p in params:
            p.requires_grad_(False)
        for m, _, _ in precisions:
            _set_precision(m, Precision.BF16)
        config.finalize_model_grads_func = None
        yield
    finally:
        config.finalize_model_grads_func = saved_finalize
        for m, prev, spec in precisions:
            _set_precision(m, prev)
            if spec is not None and getattr(m, "format_spec", None) != spec:
                m.format_spec = spec  # a custom spec (e.g. backward-only) comes back as it was
        for p, r in zip(params, requires):
            p.requires_grad_(r)


def _wrap_forward_step(forward_step_func, losses: list, zero_loss):
    """Record each micro-batch's loss (before the schedule scales it in place); zero_loss (a bool,
    or a predicate on the micro-batch index) makes the loss gradient zero while keeping the graph."""

    def forward_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def wrapped_loss(output_tensor):
            mb = len(losses)  # the loss is taken once per micro-batch, in order, on the last stage
            result = loss_func(output_tensor)
            loss = result[0]
            per = loss.detach().float().clone()
            if len(result) == 3:  # (loss sum, num tokens, logs): per-token loss mode
                per = per / result[1].float().clamp(min=1)
            losses.append(float(per))
            if zero_loss(mb) if callable(zero_loss) else zero_loss:
                result = (loss * 0.0,) + tuple(result[1:])
            return result

        return output, wrapped_loss

    return forward_step


def _run_pass(chunks, forward_step_func, batches, *, seq_length, micro_batch_size, zero_loss=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses: list = []
    data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    get_forward_backward_func()(
        forward_step_func=_wrap_forward_step(forward_step_func, losses, zero_loss), data_iterator=data,
        model=list(chunks), num_microbatches=len(batches), seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=False)
    return losses


def _halves(batches: list, micro_batch_size: int):
    """A lone micro-batch cut into two along the batch dim (every tensor whose first dim is the
    micro-batch size; the rest, e.g. a shared attention mask, is kept whole), or None if it cannot
    be (an odd size, or not a dict of tensors)."""
    if len(batches) != 1 or micro_batch_size < 2 or micro_batch_size % 2:
        return None
    (b,) = batches
    if not isinstance(b, dict) or not all(isinstance(v, torch.Tensor) for v in b.values()):
        return None
    half = micro_batch_size // 2
    return [{k: (v[i * half:(i + 1) * half] if v.dim() and v.shape[0] == micro_batch_size else v)
             for k, v in b.items()} for i in range(2)]


def _model_config(chunk):
    from megatron.core.utils import get_model_config

    return get_model_config(chunk)


def measure_step(ctx, config: MeasureConfig, **kwargs) -> "StatsTable | None":
    """The measurement of the step about to run, from a training loop's StepContext
    (snip_megatron.hooks): its chunks, forward step, optimizer and current micro-batches. The
    reduced table comes back on global rank 0, None elsewhere."""
    import torch.distributed as dist

    table = measure_chunks(ctx.chunks, ctx.forward_step_func, ctx.current_batch,
                           seq_length=ctx.seq_length, micro_batch_size=ctx.micro_batch_size,
                           optimizer=ctx.optimizer, config=config, **kwargs)
    return table if (not dist.is_initialized() or dist.get_rank() == 0) else None


def measure_chunks(model_chunks, forward_step_func, batches: list, *, seq_length: int,
                   micro_batch_size: int, optimizer=None, config: MeasureConfig = MeasureConfig(),
                   error_fn: "ErrorFn | None" = None, reduce: bool = True,
                   pp_to_all: bool = False) -> StatsTable:
    """Statistics of every planned linear for the step made of `batches` (micro-batches).

    Returns the table reduced over TP and DP and gathered over PP onto the first stage (global
    rank 0 holds all rows; every stage with `pp_to_all`). `reduce=False` returns this rank's raw
    local table (for tests)."""
    from megatron.core import parallel_state as ps

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    mconfig = _model_config(chunks[0])
    if getattr(mconfig, "sequence_parallel", False):
        raise ValueError("measure() does not support sequence_parallel=True yet; measure with it off")
    if not batches:
        raise ValueError("measure() needs the micro-batches of the step, got an empty list")
    linears = planned_linears(chunks)
    error_fn = error_fn or formats_error_fn(config.formats, config.seed)
    # the noise pass: alternate micro-batches, or the two halves of a lone one
    noise_batches, noise_mbs = batches, micro_batch_size
    interleave, halves = config.interleave_noise and len(batches) >= 2, False
    if config.interleave_noise and len(batches) == 1:
        cut = _halves(batches, micro_batch_size)
        if cut is not None:
            noise_batches, noise_mbs, interleave, halves = cut, micro_batch_size // 2, True, True
    collector = Collector(linears, num_layers=mconfig.num_layers, error_fn=error_fn,
                          precisions=config.precisions, seed=config.seed, first_order=config.first_order,
                          tp_rank=ps.get_tensor_model_parallel_rank(),
                          tp_size=ps.get_tensor_model_parallel_world_size(),
                          tp_group=ps.get_tensor_model_parallel_group(),
                          token_stride=config.error_token_stride,
                          grad_token_stride=config.grad_error_token_stride, interleave_noise=interleave,
                          noise_on_halves=halves, microbatch_offset=ps.get_data_parallel_rank(),
                          microbatch_stride=ps.get_data_parallel_world_size())
    run = dict(seq_length=seq_length, micro_batch_size=micro_batch_size)
    snap = _rng_snapshot()
    try:
        with measurement_mode(chunks, linears, mconfig):
            # 1. the BF16 statistics pass
            clean = collector.begin("clean")
            losses = _run_pass(chunks, forward_step_func, batches, **run)
            collector.end()
            _rng_restore(snap)
            for key, fields in adam.adam_statistics(optimizer, {k: m.weight for k, m in linears}).items():
                for f, v in fields.items():
                    clean.set(key, f, v)
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                clean.globals_.update(loss=sum(losses) / len(losses), num_microbatches=len(batches),
                                      dp_size=ps.get_data_parallel_world_size())
            dp_sharded = adam.is_dp_sharded(optimizer) if optimizer is not None else False
            reduced = reduce_tp_dp(clean, adam_dp_sharded=dp_sharded) if reduce else clean
            collector.set_scales(reduced, config.noise_frac, config.bwd_noise_frac)
            # 2. forward noise into every layer output at once; 3. backward noise into every input
            # gradient (zero loss gradient): one pass on alternate micro-batches, or two passes
            if interleave:
                noisy = collector.begin("noise")
                _run_pass(chunks, forward_step_func, noise_batches, seq_length=seq_length,
                          micro_batch_size=noise_mbs,
                          zero_loss=lambda mb: collector.mode_of(collector.global_microbatch(mb)) == "bwd_noise")
            else:
                noisy = collector.begin("fwd_noise")
                _run_pass(chunks, forward_step_func, batches, **run)
                _rng_restore(snap)
                collector.begin("bwd_noise", table=noisy)
                _run_pass(chunks, forward_step_func, batches, zero_loss=True, **run)
            collector.end()
    finally:
        collector.remove()
        _rng_restore(snap)
    for k in noisy.keys:  # noise rows carry only the noise fields; "present" etc. come from clean
        noisy.set(k, "present", 0.0)
        noisy.set(k, "k", 0.0)
        noisy.set(k, "m", 0.0)
    if reduce:
        noisy = reduce_tp_dp(noisy)
    out = reduced.copy()
    for f in NOISE_FIELDS:
        out.column(f)[:] += noisy.column(f)
    for p in collector.probes:
        out.set(p.key, "noise_scale", collector.scales[p.key][0])
    return gather_pp(out, to_all=pp_to_all) if reduce else out
