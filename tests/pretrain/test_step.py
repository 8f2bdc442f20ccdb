"""The step seam: the controller sees the step's micro-batches, train_step trains on exactly those,
and the measurement's passes run outside Megatron's rerun state machine like its evaluation."""

from types import SimpleNamespace

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.plan import Plan
from snip_megatron.pretrain.setup import SnipRun
from snip_megatron.pretrain.step import buffer_step, outside_rerun


class Recorder:
    """A controller stand-in that records its calls and reads the step's batch on step 2."""

    plan_source = "test"

    def __init__(self):
        self.calls, self.plan = [], Plan.uniform(2, "fp8")

    def on_train_start(self, ctx):
        self.calls.append(("train_start", ctx.step))

    def on_step_start(self, ctx, step):
        self.calls.append(("start", step))
        if step == 2:
            self.seen = ctx.current_batch

    def on_step_end(self, ctx, step, metrics):
        self.calls.append(("end", step, metrics["loss"]))

    def state_dict(self):
        return {"calls": len(self.calls)}


def test_step_seam_replays_the_measured_batches(monkeypatch):
    from megatron.core.rerun_state_machine import RerunDataIterator

    rec = Recorder()
    run = SnipRun(config=SnipConfig(enabled=True), controller=rec, num_layers=2, seq_length=32,
                  micro_batch_size=2)
    monkeypatch.setattr(SnipRun, "check_applied", lambda self, chunks: None)  # no model here
    data = RerunDataIterator(iter(range(100)))
    it = run.step_begin(1, None, ["chunk"], None, data, num_microbatches=2)
    assert it is data  # nobody read ahead: train_step reads the original iterator
    assert [next(it), next(it)] == [0, 1]
    run.step_end(1, 2.5)
    it = run.step_begin(2, None, ["chunk"], None, data, num_microbatches=2)
    assert rec.seen == [2, 3]  # the controller saw this step's micro-batches...
    assert isinstance(it, RerunDataIterator) and [next(it), next(it)] == [2, 3]  # ...and trains on them
    assert next(data) == 4  # the data position did not move
    run.step_end(2, None)
    assert rec.calls == [("train_start", 0), ("start", 1), ("end", 1, 2.5), ("start", 2), ("end", 2, None)]
    state = run.state_dict(2)
    assert state["controller"] == {"calls": 5} and Plan.from_dict(state["plan"]) == rec.plan


def test_buffering_with_virtual_pipeline_chunks():
    # Rank of the last stage under VPP: chunk 0 reads no data (None), chunk 1 does.
    replay, batches = buffer_step([None, iter(["a", "b", "c"])], 2)
    assert batches == ["a", "b"]
    assert replay[0] is None and [next(replay[1]), next(replay[1])] == ["a", "b"]
    _, nothing = buffer_step([None, None], 2)  # a middle stage reads nothing
    assert nothing == [None, None]


def test_measurement_passes_run_with_the_rerun_machine_disabled(megatron_single):
    """Megatron-LM's loss_func calls validate_result, which asserts outside a training pass."""
    import torch
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()

    def megatron_like_forward_step(data_iterator, model):
        def loss_func(output):
            machine.validate_result(result=output, rejection_func=torch.isnan, message="nan",
                                    tolerance=0.0, fatal=True)
            return output, machine.get_mode()
        return torch.tensor(1.0), loss_func

    initial = machine.get_mode()
    machine.set_mode(RerunMode.VALIDATE_RESULTS)  # Megatron-LM's default (--rerun-mode)
    try:
        with pytest.raises(AssertionError, match="outside of the forward-backward pass"):
            megatron_like_forward_step(None, None)[1](torch.tensor(1.0))
        output, loss = outside_rerun(megatron_like_forward_step)(None, None)
        assert loss(output)[1] is RerunMode.DISABLED
        assert machine.get_mode() is RerunMode.VALIDATE_RESULTS
        with pytest.raises(RuntimeError, match="nan"):  # a NaN loss still stops the pass
            loss(torch.tensor(float("nan")))
        assert machine.get_mode() is RerunMode.VALIDATE_RESULTS
    finally:
        machine.set_mode(initial)
