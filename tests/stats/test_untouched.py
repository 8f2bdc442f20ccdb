"""A measured step leaves training untouched: weights, optimizer state and RNG streams after it
equal those of an unmeasured run; the AdamW statistics equal a direct computation."""

import pytest
import torch

from snip_megatron.megatron import runtime
from snip_megatron.megatron.batch import make_forward_step
from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer
from snip_megatron.stats.discover import planned_linears
from snip_megatron.stats.measure import measure_chunks
from snip_megatron.stats.quant_error import blockwise_error_fn
from tests.stats.measure_worker import SHAPE, batches, build


def _train_step(ddp, optimizer, mbs, before_optimizer_step=None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for c in ddp:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=make_forward_step(), data_iterator=iter(mbs), model=ddp,
                                num_microbatches=len(mbs), seq_length=SHAPE.seq_length,
                                micro_batch_size=2, forward_only=False)
    if before_optimizer_step is not None:  # the hardest spot: gradients are in main_grad
        before_optimizer_step()
    optimizer.step()


def _run(measured: bool, distributed_optimizer: bool):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    chunks = build()
    ddp, opt = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-2, clip_grad=1.0,
                                      distributed_optimizer=distributed_optimizer)
    step1, step2 = batches(seed=1), batches(seed=2)
    _train_step(ddp, opt, step1)
    tables = []

    def measure_now():
        tables.append(measure_chunks(ddp, make_forward_step(), step2, seq_length=SHAPE.seq_length,
                              micro_batch_size=2, optimizer=opt, error_fn=blockwise_error_fn()))

    _train_step(ddp, opt, step2, measure_now if measured else None)
    table = tables[0] if tables else None
    params = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    state = opt.state_dict()
    rng = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    return params, state, rng, table, chunks, opt


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}.{i}")
    else:
        yield prefix, obj


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_measurement_leaves_training_untouched(megatron_single, distributed_optimizer):
    pa, sa, ra, table, _, _ = _run(True, distributed_optimizer)
    pb, sb, rb, _, _, _ = _run(False, distributed_optimizer)
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    fa, fb = dict(_flat(sa)), dict(_flat(sb))
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k
    assert torch.equal(ra[0], rb[0])
    assert ra[1].keys() == rb[1].keys() and all(torch.equal(ra[1][k], rb[1][k]) for k in ra[1])
    assert table is not None and table.nonfinite() == {}


def test_adam_statistics_equal_direct_computation(megatron_single):
    chunks = build()
    ddp, opt = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-2, clip_grad=1.0,
                                      distributed_optimizer=False)
    for seed in (1, 2):
        _train_step(ddp, opt, batches(seed=seed))
    table = measure_chunks(ddp, make_forward_step(), batches(seed=3), seq_length=SHAPE.seq_length,
                    micro_batch_size=2, optimizer=opt, error_fn=blockwise_error_fn())
    inner = opt.optimizer
    b1, b2 = inner.param_groups[0]["betas"]
    eps = inner.param_groups[0]["eps"]
    for key, mod in planned_linears(chunks):
        st = inner.state[mod.weight]
        t = float(st["step"])
        denom = (st["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt() + eps
        c = (1 - b1) / (1 - b1 ** t)
        assert table.get(key, "adam_du_sq") == pytest.approx(float(((c / denom) ** 2).sum()), rel=1e-9)
        v_hat = st["exp_avg_sq"].double() / (1 - b2 ** t)
        assert table.get(key, "adam_dv_sq") == pytest.approx(float((v_hat * (c / denom) ** 2).sum()), rel=1e-9)
        assert table.get(key, "adam_v_sum") == pytest.approx(float(v_hat.sum()), rel=1e-9)
        upd = st["exp_avg"].double() / (1 - b1 ** t) / denom
        assert table.get(key, "adam_upd_sq") == pytest.approx(float((upd ** 2).sum()), rel=1e-9)
        assert table.get(key, "adam_numel") == mod.weight.numel()
    runtime.destroy()
