"""Each statistic of measure_chunks() equals a direct computation on a tiny model (one process)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from snip_megatron.formats.precision import Precision
from snip_megatron.megatron.batch import make_forward_step, masked_mean_loss
from snip_megatron.stats import noise
from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.discover import planned_linears
from snip_megatron.stats.measure import measure_chunks
from snip_megatron.stats.quant_error import blockwise_error_fn
from tests.stats.measure_worker import SHAPE, batches, build

FP8, FP4 = Precision.FP8, Precision.FP4
CFG = MeasureConfig(noise_frac=0.05, bwd_noise_frac=0.5, seed=3, error_token_stride=1, grad_error_token_stride=1)


def _run(model, mbs, *, fwd_noise=None, bwd_noise=None, only=None):
    """Plain autograd over the micro-batches (no Megatron schedule); returns per-linear captures.
    Noise (and, with bwd_noise, a zero loss gradient) goes into the micro-batches in `only`
    (default all); the others run clean."""
    only = set(range(len(mbs))) if only is None else set(only)
    linears = planned_linears([model])
    caps = {k: [] for k, _ in linears}
    handles = []
    for key, mod in linears:
        def pre(m, args, key=key):
            x = args[0]
            mb = len(caps[key])
            if bwd_noise is not None and mb in only:
                eta = noise.layer_noise(x.shape, seed=CFG.seed, key=key, microbatch=mb,
                                        stream=noise.BACKWARD) * bwd_noise[key]
                x.register_hook(lambda g, eta=eta: g + eta)
            else:
                x.retain_grad()
            caps[key].append({"x": x})

        def post(m, args, out, key=key):
            y = out[0]
            cap = caps[key][-1]
            if fwd_noise is not None and len(caps[key]) - 1 in only:
                cap["z"] = noise.layer_noise(y.shape, seed=CFG.seed, key=key, microbatch=len(caps[key]) - 1,
                                             stream=noise.FORWARD)
                y = y + fwd_noise[key] * cap["z"]
            y.retain_grad()
            cap["y"] = y
            return (y,) + tuple(out[1:])

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    loss_sum = 0.0
    for i, b in enumerate(mbs):
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        loss = masked_mean_loss(out, b["loss_mask"]) / len(mbs)  # the schedule's 1/num_microbatches
        loss_sum += float(loss) * len(mbs)
        (loss * 0.0 if bwd_noise is not None and i in only else loss).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return dict(linears), caps, loss_sum / len(mbs)


def sq(t):
    return float(t.detach().double().pow(2).sum())


def dot(a, b):
    return float((a.detach().double() * b.detach().double()).sum())


@pytest.mark.parametrize("layout", ["two_passes", "interleaved", "halved"])
def test_statistics_equal_direct_computation(megatron_single, layout):
    """two_passes: forward noise on every micro-batch, then backward noise on every one;
    interleaved: one noise pass, forward noise on micro-batch 0, backward on 1; halved: a lone
    micro-batch of 4 sequences, whose noise pass runs its halves of 2 as interleaved."""
    model = build()[0]
    err = blockwise_error_fn()
    mbs = batches()
    config = dataclasses.replace(CFG, interleave_noise=layout != "two_passes")
    if layout == "halved":
        whole = batches(num=1, mbs=4)
        table = measure_chunks([model], make_forward_step(), whole, seq_length=SHAPE.seq_length,
                        micro_batch_size=4, config=config, error_fn=err)
        mbs = [{k: (v[:2], v[2:])[i] if v.shape[0] == 4 else v for k, v in whole[0].items()} for i in range(2)]
        clean_mbs = whole
    else:
        table = measure_chunks([model], make_forward_step(), mbs, seq_length=SHAPE.seq_length, micro_batch_size=2,
                        config=config, error_fn=err)
        clean_mbs = mbs
    fwd_mbs, bwd_mbs = ([0, 1], [0, 1]) if layout == "two_passes" else ([0], [1])
    mods, clean, loss = _run(model, clean_mbs)
    assert table.globals_["loss"] == pytest.approx(loss, rel=1e-6)
    scales = {}
    for key, caps in clean.items():
        w = mods[key].weight
        x2 = [c["x"].reshape(-1, c["x"].shape[-1]) for c in caps]
        g2 = [c["y"].grad.reshape(-1, c["y"].shape[-1]) for c in caps]
        gws = [g.t() @ x for g, x in zip(g2, x2)]
        want = dict(x_sq=sum(map(sq, x2)), w_sq=sq(w), y_sq=sum(sq(c["y"]) for c in caps),
                    gy_sq=sum(map(sq, g2)), gx_sq=sum(sq(c["x"].grad) for c in caps),
                    gw_sq=sum(map(sq, gws)), n=sum(x.shape[0] for x in x2),
                    k=w.shape[1], m=w.shape[0])
        for p in (FP8, FP4):
            ew = err(w.detach(), p, "fprop_weight")
            want[f"ew.{p}"] = sq(ew)
            want[f"ew_d.{p}"] = sq(err(w.detach(), p, "dgrad_weight"))
            want[f"ex.{p}"] = sum(sq(err(x.detach(), p, "fprop_input")) for x in x2)
            want[f"ex_w.{p}"] = sum(sq(err(x.detach(), p, "wgrad_input")) for x in x2)
            want[f"egy_d.{p}"] = sum(sq(err(g, p, "dgrad_grad_output")) for g in g2)
            want[f"egy_w.{p}"] = sum(sq(err(g, p, "wgrad_grad_output")) for g in g2)
            want[f"gx_ex.{p}"] = sum(dot(c["x"].grad.reshape(x.shape), err(x.detach(), p, "fprop_input"))
                                     for c, x in zip(caps, x2))
            want[f"gw_ew.{p}"] = sum(dot(gw, ew) for gw in gws)
            # the output error of the quantized forward GEMM, and its per-token projection on G_Y
            dys = [(x.detach() + err(x.detach(), p, "fprop_input")) @ (w.detach() + ew).t() - x.detach() @ w.detach().t()
                   for x in x2]
            want[f"dy_sq.{p}"] = sum(map(sq, dys))
            want[f"gdy_sq.{p}"] = sum(sq((g.detach() * dy).sum(1)) for g, dy in zip(g2, dys))
        for f, v in want.items():
            assert table.get(key, f) == pytest.approx(v, rel=1e-5, abs=1e-10), (key, f)
        if layout == "halved":  # noise micro-batch 0 is the first half of the clean one ([s, b, h])
            g0 = caps[0]["y"].grad[:, :2]
            zg = dot(noise.layer_noise(g0.shape, seed=CFG.seed, key=key, microbatch=0, stream=noise.FORWARD), g0)
        else:
            zg = sum(dot(noise.layer_noise(c["y"].shape, seed=CFG.seed, key=key, microbatch=i,
                                           stream=noise.FORWARD), c["y"].grad) for i, c in enumerate(caps)
                     if i in fwd_mbs)
        assert table.get(key, "fwd_zg_clean") == pytest.approx(zg, rel=1e-4, abs=1e-9)
        s = CFG.noise_frac * math.sqrt(want["y_sq"] / (want["n"] * want["m"]))
        t = CFG.bwd_noise_frac * math.sqrt(want["gx_sq"] / (want["n"] * want["k"]))
        assert table.get(key, "noise_scale") == pytest.approx(s, rel=1e-6)
        scales[key] = (s, t)

    # forward-noise pass: s*z into every output at once
    _, noisy, _ = _run(model, mbs, fwd_noise={k: v[0] for k, v in scales.items()}, only=fwd_mbs)
    for key, caps in noisy.items():
        caps = [c for i, c in enumerate(caps) if i in fwd_mbs]
        assert table.get(key, "fwd_z_sq") == pytest.approx(sum(sq(c["z"]) for c in caps), rel=1e-6)
        zg = sum(dot(c["z"], c["y"].grad) for c in caps)
        # a signed sum: float32 summation order differs from the schedule's, so the tolerance is
        # relative to its Cauchy-Schwarz bound
        bound = math.sqrt(sum(sq(c["z"]) for c in caps) * sum(sq(c["y"].grad) for c in caps))
        assert table.get(key, "fwd_zg_noisy") == pytest.approx(zg, rel=1e-4, abs=1e-5 * bound)
    # backward-noise pass: t*eta into every input gradient, zero loss gradient
    _, bwd, _ = _run(model, mbs, bwd_noise={k: v[1] for k, v in scales.items()}, only=bwd_mbs)
    for key, caps in bwd.items():
        caps = {i: c for i, c in enumerate(caps) if i in bwd_mbs}
        d = sum(sq(c["y"].grad.reshape(-1, c["y"].shape[-1]).t() @ c["x"].detach().reshape(-1, c["x"].shape[-1]))
                for c in caps.values())
        assert table.get(key, "bwd_dgw_sq") == pytest.approx(d, rel=1e-4, abs=1e-12)
        eta = sum(sq(noise.layer_noise(c["x"].shape, seed=CFG.seed, key=key, microbatch=i,
                                       stream=noise.BACKWARD) * scales[key][1]) for i, c in caps.items())
        assert table.get(key, "bwd_eta_sq") == pytest.approx(eta, rel=1e-6)
    assert table.nonfinite() == {}


def test_nonfinite_statistics_reported_per_layer(megatron_single):
    from snip_megatron.estimate import cost_table

    model = build()[0]
    base = blockwise_error_fn()
    fc2_shape = (SHAPE.hidden_size, SHAPE.ffn_hidden_size)

    def err(t, p, role, group=None):  # an Inf error for the fc2 weights only
        e = base(t, p, role)
        return e + math.inf if role == "fprop_weight" and tuple(t.shape) == fc2_shape else e

    table = measure_chunks([model], make_forward_step(), batches(), seq_length=SHAPE.seq_length,
                    micro_batch_size=2, config=CFG, error_fn=err)
    bad = table.nonfinite()
    assert {k.name for k in bad} == {"linear_fc2"} and len(bad) == SHAPE.num_layers
    costs = cost_table(table)
    for k in table.keys:
        finite = math.isfinite(costs.costs[k][FP4])
        assert finite == (k not in bad)


def test_token_subsampled_errors_close_to_full(megatron_single):
    model = build()[0]
    run = dict(seq_length=SHAPE.seq_length, micro_batch_size=2, error_fn=blockwise_error_fn())
    run["micro_batch_size"] = 8  # 256 tokens per micro-batch: stride 2 keeps 8 of 16 chunks
    mbs = batches(mbs=8)
    full = measure_chunks([model], make_forward_step(), mbs, config=CFG, **run)
    sub = measure_chunks([model], make_forward_step(), mbs,
                  config=MeasureConfig(noise_frac=0.05, bwd_noise_frac=0.5, seed=3, error_token_stride=2,
                                       grad_error_token_stride=2), **run)
    for f in ("ex", "ex_w", "egy_d", "egy_w"):
        for p in (FP8, FP4):
            a, b = full.column(f"{f}.{p}"), sub.column(f"{f}.{p}")
            # a 128-token sample per micro-batch of a tiny model: loose per layer, tighter in total
            np.testing.assert_allclose(b, a, rtol=0.5, err_msg=f"{f}.{p}")
            assert b.sum() == pytest.approx(a.sum(), rel=0.2), (f, p)
            assert not np.array_equal(a, b)  # it did subsample
    for f in ("x_sq", "gy_sq", "ew.fp4", "fwd_zg_noisy"):  # untouched by the stride
        np.testing.assert_allclose(sub.column(f), full.column(f), rtol=1e-6, err_msg=f)
    # ||G_W||^2 on the token sample (exact per-chunk terms + the sampled cross terms, stats/tokens.py)
    for f in ("gw_sq", "bwd_dgw_sq"):
        a, b = full.column(f)[:-1], sub.column(f)[:-1]  # the last bwd_dgw_sq is 0: nothing after it
        np.testing.assert_allclose(b, a, rtol=0.3, err_msg=f)
        assert b.sum() == pytest.approx(a.sum(), rel=0.15), f
        assert not np.array_equal(a, b)


def test_grad_error_stride_samples_only_the_backward_roles(megatron_single):
    model = build()[0]
    run = dict(seq_length=SHAPE.seq_length, micro_batch_size=8, error_fn=blockwise_error_fn())
    mbs = batches(mbs=8)
    full = measure_chunks([model], make_forward_step(), mbs, config=CFG, **run)
    sub = measure_chunks([model], make_forward_step(), mbs, config=dataclasses.replace(CFG, grad_error_token_stride=2), **run)
    for p in (FP8, FP4):
        for f in ("ex", "dy_sq", "gdy_sq", "gx_ex", "ew_d"):  # forward roles and weights: every token
            np.testing.assert_allclose(sub.column(f"{f}.{p}"), full.column(f"{f}.{p}"), rtol=1e-6, err_msg=f)
        for f in ("ex_w", "egy_d", "egy_w"):  # the backward roles: a scaled-up half
            a, b = full.column(f"{f}.{p}"), sub.column(f"{f}.{p}")
            assert not np.array_equal(a, b)
            assert b.sum() == pytest.approx(a.sum(), rel=0.2), (f, p)
    with pytest.raises(ValueError, match="grad_error_token_stride"):
        MeasureConfig(grad_error_token_stride=0)


def test_an_exception_in_a_statistics_hook_fails_the_measurement_by_name(megatron_single):
    """The hook records it and the pass runs on (so other ranks' collectives are matched); the
    measurement then raises MeasurementFailed on every rank (agree_on_failure)."""
    from snip_megatron.stats.measure import MeasurementFailed

    model = build()[0]
    base = blockwise_error_fn()
    fc1_shape = (2 * SHAPE.ffn_hidden_size, SHAPE.hidden_size)

    def err(t, p, role, group=None):
        if role == "fprop_weight" and tuple(t.shape) == fc1_shape:
            raise RuntimeError("no quantizer for this tensor")
        return base(t, p, role)

    with pytest.raises(MeasurementFailed, match=r"the statistics pass: 2\.linear_fc1: RuntimeError: no quantizer"):
        measure_chunks([model], make_forward_step(), batches(), seq_length=SHAPE.seq_length,
                       micro_batch_size=2, config=CFG, error_fn=err)
    with pytest.raises(MeasurementFailed, match="setting up the measurement: ValueError: .*empty list"):
        measure_chunks([model], make_forward_step(), [], seq_length=SHAPE.seq_length, micro_batch_size=2)
    assert not any(p.grad is not None for p in model.parameters())  # training untouched
