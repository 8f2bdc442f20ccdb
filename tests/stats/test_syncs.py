"""A measurement reads its statistics back to the host a fixed number of times, whatever the
number of layers and micro-batches: every statistic stays on the device until the one transfer
after the reduction. An emulated training step (FP8 and NVFP4 linears, stochastic rounding, either
GEMM path) reads nothing back. Ceilings: 2 reads per measurement (the table: `cpu`, `numpy`), 0 per
emulated training step.

A CPU stand-in for a GPU's host syncs: every Tensor method that hands a value to Python or copies
a tensor to the host (`item`, `float()`, `int()`, `bool()`, `tolist`, `cpu`, `numpy`) is counted
while measure_chunks() runs, by who asked for it: the first caller outside torch is in snip_megatron
(ours) or elsewhere. The only other reads are Megatron's own: its RNG tracker compares two CPU
RNG states on every attention forward (a CPU tensor, no device sync, the same in training).
Reads inside `draw_seed` are counted apart ("host"): its generator is always a CPU one (a device
generator is read through its host twin, tests/formats/test_sr_noise.py), so no device sync."""

import contextlib
import sys

import pytest
import torch

from snip_megatron.formats.sr_noise import draw_seed
from snip_megatron.megatron import cpu_shim, runtime
from snip_megatron.megatron.batch import make_forward_step
from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer
from snip_megatron.stats.config import MeasureConfig
from snip_megatron.stats.measure import measure_chunks
from snip_megatron.stats.quant_error import blockwise_error_fn, formats_error_fn
from tests.stats.measure_worker import SHAPE, batches

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy")


@contextlib.contextmanager
def counting_host_reads():
    counts = {who: {name: 0 for name in READS} for who in ("ours", "megatron", "host")}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def caller() -> str:
        frame = sys._getframe(2)
        while frame is not None and (f"{torch.__name__}/" in frame.f_code.co_filename.replace("\\", "/")
                                     or frame.f_code.co_filename in (__file__, cpu_shim.__file__)):
            frame = frame.f_back
        return "ours" if frame is not None and "snip_megatron" in frame.f_code.co_filename else "megatron"

    def counted(name):
        original = saved[name]

        def method(self, *args, **kwargs):
            code = sys._getframe(1).f_code
            if code.co_filename != cpu_shim.__file__:  # not the shim re-dispatching
                counts["host" if code is draw_seed.__code__ else caller()][name] += 1
            return original(self, *args, **kwargs)

        return method

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def _reads(num_layers: int, num_mb: int, with_optimizer: bool, error_fn=blockwise_error_fn) -> dict:
    from snip_megatron.megatron.model import build_model_chunks

    runtime.initialize_model_parallel(tp=1, pp=1)
    chunks = build_model_chunks(SHAPE.with_(num_layers=num_layers), backend="local")
    model, optimizer = chunks, None
    if with_optimizer:  # AdamW state, so the optimizer statistics are read too
        model, optimizer = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-3, clip_grad=0.0,
                                                  distributed_optimizer=False)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        get_forward_backward_func()(forward_step_func=make_forward_step(), data_iterator=iter(batches(seed=1)),
                                    model=model, num_microbatches=2, seq_length=SHAPE.seq_length,
                                    micro_batch_size=2, forward_only=False)
        optimizer.step()
    run = dict(seq_length=SHAPE.seq_length, micro_batch_size=2, error_fn=error_fn(),
               config=MeasureConfig(noise_frac=0.05, micro_batches=None), optimizer=optimizer)
    data = batches(num=num_mb)
    with counting_host_reads() as counts:
        table = measure_chunks(model, make_forward_step(), data, **run)
    assert table.nonfinite() == {} and (table.column("present") == 1).all()
    runtime.destroy()
    return {who: {k: v for k, v in c.items() if v} for who, c in counts.items()}


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_host_reads_do_not_grow_with_layers_or_microbatches(megatron_single, with_optimizer):
    small = _reads(2, 2, with_optimizer)
    large = _reads(4, 4, with_optimizer)
    assert small["ours"] == large["ours"], (small, large)
    assert small["ours"] == {"cpu": 1, "numpy": 1}, small  # the table, after the last reduction
    # Megatron's: one CPU RNG-state comparison per attention forward (2 passes)
    assert small["megatron"] == {"item": 2 * 2 * 2} and large["megatron"] == {"item": 2 * 4 * 4}, (small, large)


def test_a_measurement_with_the_formats_quantizers_reads_no_more(megatron_single):
    # NVFP4's stochastic rounding draws one seed per cast, on the host: nothing more is read.
    reads = _reads(2, 2, False, error_fn=formats_error_fn)
    assert reads["ours"] == {"cpu": 1, "numpy": 1}, reads
    assert reads["host"].get("tolist", 0) > 0, reads


def _emulated_step_reads(num_layers: int, num_mb: int) -> dict:
    """Host reads of one training step (Megatron's schedule, DDP, optimizer) of a model whose
    planned linears run FP8 (layer 1) and NVFP4 with stochastic rounding (the rest)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.formats import Precision
    from snip_megatron.megatron.apply import apply_plan
    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.models import gpt
    from snip_megatron.plan import Plan

    runtime.initialize_model_parallel(tp=1, pp=1)
    chunks = build_model_chunks(SHAPE.with_(num_layers=num_layers), backend="emulated")
    apply_plan(chunks, Plan({k: Precision.FP8 if k.layer == 1 else Precision.FP4 for k in gpt.keys(num_layers)}))
    model, optimizer = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-3, clip_grad=0.0,
                                              distributed_optimizer=False)
    with counting_host_reads() as counts:
        get_forward_backward_func()(forward_step_func=make_forward_step(), data_iterator=iter(batches(num=num_mb)),
                                    model=model, num_microbatches=num_mb, seq_length=SHAPE.seq_length,
                                    micro_batch_size=2, forward_only=False)
        optimizer.step()
    runtime.destroy()
    return {who: {k: v for k, v in c.items() if v} for who, c in counts.items()}


@pytest.mark.parametrize("gemm", ["fp32", "tensor_core"])
def test_an_emulated_training_step_reads_nothing_back(megatron_single, monkeypatch, gemm):
    monkeypatch.setenv("SNIP_EMULATED_GEMM", gemm)
    small, large = _emulated_step_reads(2, 1), _emulated_step_reads(3, 2)
    assert small["ours"] == {} == large["ours"] and small["host"] == {} == large["host"], (small, large)
