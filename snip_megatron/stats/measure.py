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
the global and Megatron RNG states are restored (noise and stochastic rounding use dedicated
generators), and Megatron's multi-token-prediction loss is scaled as the returned loss and kept out
of the step's log (megatron/mtp_loss.py).

The passes run MeasureConfig.micro_batches of the step's micro-batches (stats/microbatches.py),
and their sums are scaled up to the step. Statistics stay on the device; the table reaches the
host once, after the last reduction. Activation recompute (full or selective), sequence and
context parallelism, virtual pipelining and the distributed / precision-aware optimizer are
handled (docs/method.md, section 10).
"""

from __future__ import annotations

import contextlib

import torch

from snip_megatron.formats.precision import Precision
from snip_megatron.stats import adam, routing
from snip_megatron.stats.expert_rows import attached as expert_rows_over_cp
from snip_megatron.stats.accumulator import to_table
from snip_megatron.stats.collector import Collector
from snip_megatron.stats.config import MeasureConfig
from snip_megatron.megatron.apply import is_te_linear, list_planned_linears
from snip_megatron.megatron.gemm_view import is_grouped_linear, unfused, unfused_grouped
from snip_megatron.megatron.mtp_loss import mtp_log_untouched, scaled_mtp_loss
from snip_megatron.models.inventory import ParallelKind
from snip_megatron.models import gpt
from snip_megatron.stats.discover import _unwrap
from snip_megatron.stats.microbatches import sample_microbatches, step_positions, summed_mask
from snip_megatron.stats.quant_error import ErrorFn, formats_error_fn
from snip_megatron.stats.collector import ShardGroup
from snip_megatron.stats.reduce import (ADAM_FIELDS, cp_summed_mask, expert_groups, gather_pp_tensor,
                                        megatron_groups, reduce_experts_tensor, reduce_tp_dp_tensor,
                                        tp_sharded_mask)
from snip_megatron.stats.table import GLOBAL_FIELDS, StatsTable

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


def _input_requires_grad(module, args, kwargs):
    """Forward pre-hook of a TransformerBlock: the first stage's decoder input (the embedding
    output, which needs no gradient once parameters are frozen) requires grad, so gradients reach
    every layer, also through activation checkpoints (which run no backward for inputs without)."""
    if not torch.is_grad_enabled():
        return None
    if "hidden_states" in kwargs:
        hs = kwargs["hidden_states"]
        if isinstance(hs, torch.Tensor) and not hs.requires_grad:
            return args, {**kwargs, "hidden_states": hs.detach().requires_grad_(True)}
    elif args and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
        return (args[0].detach().requires_grad_(True),) + tuple(args[1:]), kwargs
    return None


@contextlib.contextmanager
def measurement_mode(model_chunks, linears, config):
    """Parameters frozen, planned linears in BF16, no gradient finalisation, gradients from the
    decoder input on; all undone after."""
    params = [p for c in model_chunks for p in c.parameters()]
    requires = [p.requires_grad for p in params]
    precisions = [(m, m.precision, getattr(m, "format_spec", None)) for _, m in linears
                  if hasattr(m, "precision")]
    saved_finalize = getattr(config, "finalize_model_grads_func", None)
    handles = []
    try:
        for chunk in model_chunks:
            decoder = getattr(_unwrap(chunk), "decoder", None)
            if decoder is not None:
                handles.append(decoder.register_forward_pre_hook(_input_requires_grad, with_kwargs=True))
        for p in params:
            p.requires_grad_(False)
        for m, _, _ in precisions:
            _set_precision(m, Precision.BF16)
        config.finalize_model_grads_func = None
        yield
    finally:
        for h in handles:
            h.remove()
        config.finalize_model_grads_func = saved_finalize
        for m, prev, spec in precisions:
            _set_precision(m, prev)
            if spec is not None and getattr(m, "format_spec", None) != spec:
                m.format_spec = spec  # a custom spec (e.g. backward-only) comes back as it was
        for p, r in zip(params, requires):
            p.requires_grad_(r)


def _wrap_forward_step(forward_step_func, losses: list, factor):
    """Record each micro-batch's loss (before the schedule scales it in place) as a device tensor;
    the loss the schedule backpropagates is multiplied by factor(micro-batch index) (0 keeps the
    graph with a zero gradient)."""

    def forward_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def wrapped_loss(output_tensor):
            mb = len(losses)  # the loss is taken once per micro-batch, in order, on the last stage
            result = loss_func(output_tensor)
            loss = result[0]
            per = loss.detach().float().clone()
            if len(result) == 3:  # (loss sum, num tokens, logs): per-token loss mode
                per = per / result[1].float().clamp(min=1)
            losses.append(per)
            f = factor(mb)
            if f != 1.0:
                result = (loss * f,) + tuple(result[1:])
            return result

        return output, wrapped_loss

    return forward_step


def _run_pass(chunks, forward_step_func, batches, *, seq_length, micro_batch_size, zero_loss=False,
              loss_factor: float = 1.0):
    """Run the micro-batches through Megatron's schedule; the per-micro-batch losses (device
    tensors, last stage only). zero_loss (a bool, or a predicate on the micro-batch index) makes a
    micro-batch's loss gradient zero; loss_factor scales the others' (a sampled micro-batch keeps
    the gradient scale it has in the whole step)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses: list = []
    data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)

    def factor(mb: int) -> float:  # what micro-batch mb's losses, returned and MTP, are multiplied by
        return 0.0 if (zero_loss(mb) if callable(zero_loss) else zero_loss) else loss_factor

    # Megatron's MTP loss is not the one the forward step returns; the micro-batch whose forward
    # attaches it is the one whose loss is taken next
    with scaled_mtp_loss(lambda: factor(len(losses))):
        get_forward_backward_func()(
            forward_step_func=_wrap_forward_step(forward_step_func, losses, factor),
            data_iterator=data, model=list(chunks), num_microbatches=len(batches), seq_length=seq_length,
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

    inventory = getattr(ctx, "inventory", None)  # the model's linears (default: a dense GPT's)
    if inventory is not None:
        kwargs.setdefault("keys", list(inventory.keys()))
    table = measure_chunks(ctx.chunks, ctx.forward_step_func, ctx.current_batch,
                           seq_length=ctx.seq_length, micro_batch_size=ctx.micro_batch_size,
                           optimizer=ctx.optimizer, config=config, **kwargs)
    return table if (not dist.is_initialized() or dist.get_rank() == 0) else None


class MeasurementFailed(RuntimeError):
    """The measurement failed on some rank, and every rank knows it (one all-reduce of a flag): the
    caller skips this update on every rank. The message holds this rank's cause, if it had one."""


def agree_on_failure(error: "str | None", what: str) -> None:
    """Every rank calls this at the same point: raise MeasurementFailed on all of them when any rank
    brings an error (one all-reduce, MAX of a flag, over every rank)."""
    import torch.distributed as dist

    failed = error is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        flag = torch.full((1,), int(failed), dtype=torch.int64, device=device)  # filled there: no copy
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())  # the one host sync of an agreement
    if failed:
        raise MeasurementFailed(f"{what}: {error}" if error is not None else f"{what}: failed on another rank")


def measure_chunks(model_chunks, forward_step_func, batches: list, *, seq_length: int,
                   micro_batch_size: int, optimizer=None, config: MeasureConfig = MeasureConfig(),
                   error_fn: "ErrorFn | None" = None, reduce: bool = True,
                   pp_to_all: bool = False, keys=None) -> StatsTable:
    """Statistics of every planned linear for the step made of `batches` (micro-batches).

    Measures `config.micro_batches` of them (stats/microbatches.py), scaled up to the step.
    Returns the table reduced over TP, CP and DP and gathered over PP onto the first stage
    (global rank 0 holds all rows; every stage with `pp_to_all`). `reduce=False` returns this
    rank's local table, unreduced (for tests). Statistics stay on the device until the one
    transfer at the end. `keys`: the table's rows, every planned linear of the model in forward
    order (its inventory's keys; default: a GPT of the config's layers and attention)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with contextlib.ExitStack() as views:  # every unfused TE linear gets its forward back
        setup_error = None
        try:
            chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
            mconfig = _model_config(chunks[0])
            if not batches:
                raise ValueError("measure() needs the micro-batches of the step, got an empty list")
            tp = ps.get_tensor_model_parallel_world_size()
            sp = bool(getattr(mconfig, "sequence_parallel", False)) and tp > 1
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            cp = ps.get_context_parallel_world_size()
            keys = gpt.of_config(mconfig).keys() if keys is None else keys
            experts = [k for k in keys if gpt.is_expert(k)]  # routed experts: the expert grid's groups
            # under CP each rank's experts run its own tokens: their rows are gathered over CP
            # (stats/expert_rows.py), where the dispatcher moves no token between ranks
            rows_of = {}
            if experts and cp > 1:
                wide = {"TP": tp, "EP": ps.get_expert_model_parallel_world_size(),
                        "expert TP": ps.get_expert_tensor_parallel_world_size()}
                if any(v > 1 for v in wide.values()):
                    raise ValueError("SNIP measures routed experts under context parallelism at TP = EP = expert TP "
                                     f"= 1 only (support rule moe-cp), got {wide}")
                rows_of = views.enter_context(expert_rows_over_cp(chunks, ps.get_context_parallel_rank(), cp,
                                                                  ps.get_context_parallel_group()))
            # TE linears run unfused and unquantized while measured (megatron/gemm_view.py)
            planned = list_planned_linears(chunks)
            kinds = {pl.key: pl.entry.kind for pl in planned}
            linears, expert_linear_rows = [], {}
            for pl in planned:
                layer_rows, index = rows_of.get(id(pl.module), (None, None))
                if is_grouped_linear(pl.module):  # one view per expert GEMM, as SequentialMLP's experts
                    column = kinds[pl.key] is ParallelKind.COLUMN
                    grouped = views.enter_context(unfused_grouped(pl.module, column))
                    linears += [(pl.key, v) for v in grouped]
                    if layer_rows is not None:  # view i: local expert i
                        expert_linear_rows.update({id(v): (layer_rows, i) for i, v in enumerate(grouped)})
                    continue
                if layer_rows is not None:
                    expert_linear_rows[id(pl.module)] = (layer_rows, index)
                if is_te_linear(pl.module):
                    linears.append((pl.key, views.enter_context(unfused(
                        pl.module, column=kinds[pl.key] is ParallelKind.COLUMN,
                        duplicated=kinds[pl.key] is ParallelKind.DUPLICATED))))
                else:
                    linears.append((pl.key, pl.module))
            error_fn = error_fn or formats_error_fn(config.formats, config.seed)
            # the interleaved schedule (virtual pipeline) runs micro-batches in groups of at least PP
            group = (getattr(mconfig, "microbatch_group_size_per_vp_stage", None) or ps.get_pipeline_model_parallel_world_size()) \
                if len(chunks) > 1 else 1
            # an expert group wider than TP (EP over data-parallel replicas) runs every replica's
            # tokens through each expert in one forward: every replica measures alike (the same
            # number of micro-batches, the same pass at a time)
            spans = bool(experts) and tp % (ps.get_expert_tensor_parallel_world_size()
                                             * ps.get_expert_model_parallel_world_size()) != 0
            k_wanted = config.micro_batches
            if spans and k_wanted:
                k_wanted = -(-k_wanted // dp) * dp
            picked, k_total = sample_microbatches(len(batches), dp_rank, dp, k_wanted, multiple=group)
            positions = step_positions(len(batches), dp_rank, dp, k_wanted, multiple=group)
            measured = [batches[i] for i in picked]
            per_token = bool(getattr(mconfig, "calculate_per_token_loss", False))
            # a CP rank's gradient is CP times its share of its replica's (Megatron's DDP averages
            # it over DP x CP, unless the loss is per token): the passes backpropagate the replica's
            loss_factor = 1.0 if per_token else len(measured) / len(batches) / cp
            step_factor = dp * len(batches) / k_total  # sums over the sample -> a replica's whole step
            # the noise pass: alternate micro-batches of the step's sample, or the two halves of a
            # lone one (decided for the whole sample, so every replica interleaves alike)
            noise_batches, noise_mbs = measured, micro_batch_size
            # (interleaving would put one replica's tokens into another's pass mode)
            interleave, halves = config.interleave_noise and k_total >= 2 and not spans, False
            # an MoE layer's experts see routed rows, not [s, b] halves: MoE models keep whole micro-batches
            moe = bool(routing.routers(chunks))
            if config.interleave_noise and k_total == 1 and len(measured) == 1 and not moe:
                cut = _halves(measured, micro_batch_size)
                if cut is not None:
                    noise_batches, noise_mbs, interleave, halves = cut, micro_batch_size // 2, True, True
            device = next(iter(chunks[0].parameters())).device
            etp = ShardGroup(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                             ps.get_expert_tensor_parallel_group()) if experts else None
            collector = Collector(linears, keys=keys, expert_keys=experts, expert_group=etp,
                                  ep_rank=ps.get_expert_model_parallel_rank() if experts else 0,
                                  kinds=kinds, error_fn=error_fn,
                                  precisions=config.precisions, seed=config.seed, first_order=config.first_order,
                                  tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                                  tp_group=ps.get_tensor_model_parallel_group(),
                                  token_stride=config.error_token_stride,
                                  grad_token_stride=config.grad_error_token_stride, interleave_noise=interleave,
                                  noise_on_halves=halves, sequence_parallel=sp,
                                  cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
                                  cp_group=ps.get_context_parallel_group(), device=device,
                                  step_positions=positions, expert_rows=expert_linear_rows)
        except Exception as exc:  # noqa: BLE001 - agreed on below, so no rank is left waiting
            setup_error = f"{type(exc).__name__}: {exc}"
        agree_on_failure(setup_error, "setting up the measurement")
        layout = collector.acc.layout
        reducing = reduce and dist.is_initialized()
        if reducing:
            tp_group, cp_group, dp_group, pp_group = megatron_groups()
            tp_mask = torch.from_numpy(tp_sharded_mask(layout, kinds, sp)).to(device)
            cp_mask = torch.from_numpy(cp_summed_mask(layout)).to(device)
            adam_cols = [layout.col(f) for f in ADAM_FIELDS]
            expert_rows = [layout.row_index(k) for k in experts]
            if expert_rows:
                etp_group, ep_group, edp_group = expert_groups()
                etp_mask = torch.from_numpy(tp_sharded_mask(layout, {k: v for k, v in kinds.items()
                                                                     if k in set(experts)})).to(device)
        summed = torch.from_numpy(summed_mask(layout)).to(device)

        def finish(t: torch.Tensor, adam_dp_sharded: bool = False) -> torch.Tensor:
            """A pass's local sums -> estimates for the step, reduced over TP, CP and DP."""
            t = torch.where(summed, t * step_factor, t)
            if not reducing:
                return t
            dense = reduce_tp_dp_tensor(t, tp_mask, adam_cols, tp_group=tp_group, dp_group=dp_group,
                                        cp_group=cp_group, cp_mask=cp_mask, adam_dp_sharded=adam_dp_sharded)
            if not expert_rows:
                return dense
            experts_t = reduce_experts_tensor(t, expert_rows, etp_mask, summed, adam_cols, etp_group=etp_group,
                                              ep_group=ep_group, edp_group=edp_group, dense_dp=dp,
                                              adam_dp_sharded=adam_dp_sharded, cp=cp, cp_mask=cp_mask)
            rows = torch.tensor(expert_rows, device=t.device)
            return dense.index_copy(0, rows, experts_t.index_select(0, rows))

        run = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, loss_factor=loss_factor)
        snap = _rng_snapshot()
        try:
            with measurement_mode(chunks, linears, mconfig), mtp_log_untouched(), \
                    routing.frozen_routing(chunks) as routes:
                # 1. the BF16 statistics pass (MoE routers record their choices; the noise passes replay them)
                routes.record()
                clean = collector.begin("clean")
                losses = _run_pass(chunks, forward_step_func, measured, **run) if measured else []
                for probe in collector.probes:  # a replica that measured nothing still has weights
                    probe.weight_stats()
                collector.end()
                _rng_restore(snap)
                adam.adam_statistics(optimizer, [(k, m.weight) for k, m in linears],
                                     add=lambda key, f, v: clean.add(clean.row(key), clean.col(f), v))
                if ps.is_pipeline_last_stage(ignore_virtual=True):
                    g = len(layout.keys)
                    if losses:  # the mean over every replica's sample, after the DP mean
                        clean.add(g, GLOBAL_FIELDS.index("loss"), torch.stack(losses).sum() * (dp / k_total))
                    clean.set_host(g, GLOBAL_FIELDS.index("num_microbatches"), float(len(batches)))
                    clean.set_host(g, GLOBAL_FIELDS.index("dp_size"), float(dp))
                # agreed on with the noise pass's errors, in one flag: every rank runs the passes'
                # collectives whatever its hooks caught, so a failed rank goes on without hanging the others
                stats_errors = len(collector.errors)
                dp_sharded = adam.is_dp_sharded(optimizer) if optimizer is not None else False
                reduced = finish(clean.tensor(), dp_sharded)
                collector.set_scales(reduced, config.noise_frac, config.bwd_noise_frac)
                # 2. forward noise into every layer output at once; 3. backward noise into every input
                # gradient (zero loss gradient): one pass on alternate micro-batches, or two passes
                routes.replay()
                if interleave:
                    noisy = collector.begin("noise")
                    _run_pass(chunks, forward_step_func, noise_batches, seq_length=seq_length,
                              micro_batch_size=noise_mbs, loss_factor=loss_factor,
                              zero_loss=lambda mb: collector.mode_of(collector.step_microbatch(mb)) == "bwd_noise")
                else:
                    noisy = collector.begin("fwd_noise")
                    if measured:
                        _run_pass(chunks, forward_step_func, measured, **run)
                        _rng_restore(snap)
                    collector.begin("bwd_noise", acc=noisy)
                    routes.replay()
                    if measured:
                        _run_pass(chunks, forward_step_func, measured, zero_loss=True, **run)
                collector.end()
                errors = collector.errors
                agree_on_failure("; ".join(errors[:stats_errors] if stats_errors else errors) or None,
                                 "the statistics pass" if stats_errors else
                                 "the noise pass" if errors else "the measurement's passes")
        finally:
            collector.remove()
            _rng_restore(snap)
        noise_cols = [layout.col(f) for f in NOISE_FIELDS]
        noisy_t = finish(noisy.tensor())  # only its noise fields are used ("present" etc. come from clean)
        out = reduced.clone()
        out[:, noise_cols] += noisy_t[:, noise_cols]
        rows = [layout.row_index(p.key) for p in collector.probes]
        if rows:
            idx = torch.tensor(rows, device=device)
            out[idx, layout.col("noise_scale")] = collector.scales[idx, 0]
        if reducing:
            out = gather_pp_tensor(out, pp_group=pp_group, to_all=pp_to_all)
        return to_table(out, layout)
