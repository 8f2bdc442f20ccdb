"""The table of SNIP's seams into Megatron (snip_megatron/megatron/seams.py): every seam holds on
this Megatron, docs/seams.md is the table, and each kind of check fails, naming the seam, when
Megatron changes what it checks."""

import types

import pytest

from snip_megatron.megatron import seam_check, seams
from snip_megatron.megatron.seams import SEAMS, Seam

try:
    import megatron.training.training  # noqa: F401
    HAVE_TRAINING = True
except Exception:  # megatron-core < 0.19 (compat lane)
    HAVE_TRAINING = False


def test_every_seam_of_megatron_core_holds_here():
    seam_check.check("core")  # the compat lane too: megatron-core 0.16


@pytest.mark.skipif(not HAVE_TRAINING, reason="megatron.training ships only with megatron-core >= 0.19 (prod lane)")
def test_every_seam_of_megatron_lms_loop_holds_here():
    seam_check.check("megatron-lm")
    assert set(seams.wrapped("megatron-lm")) == {
        ("megatron.training.training", "train_step"), ("megatron.training.training", "save_checkpoint"),
        ("megatron.training.checkpointing", "schedule_async_save"), ("megatron.training.models.gpt", "mtp_block_spec")}


def test_the_doc_is_the_table():
    assert seam_check.DOC.read_text() == seams.document(), \
        "docs/seams.md is stale: run python -m snip_megatron.megatron.seam_check --write-doc"
    assert len(seams.document().splitlines()) == 6 + len(SEAMS)


def _copy(fn, **globals_):
    """`fn` looking its globals up in a copy of its module's, with `globals_` changed."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, **globals_}, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def test_a_wrapped_function_megatron_reaches_another_way_is_named(monkeypatch):
    from megatron.core.tensor_parallel import random

    seam = Seam("core", "megatron.core.tensor_parallel.random:_get_cuda_rng_state", "test",
                called_by=("megatron.core.tensor_parallel.random:_set_cuda_rng_state",))
    # _set_cuda_rng_state does not call _get_cuda_rng_state: as a caller that stopped looking it up
    assert seam_check.problems(seam) == [
        "megatron.core.tensor_parallel.random._set_cuda_rng_state no longer looks _get_cuda_rng_state up in "
        "megatron.core.tensor_parallel.random, so SNIP's wrapper there would never run"]
    caller = Seam("core", "megatron.core.tensor_parallel.random:initialize_rng_tracker", "test",
                  called_by=("megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed",))
    assert seam_check.problems(caller) == []
    # the same caller, its globals elsewhere (a Megatron that imports the function into another module)
    monkeypatch.setattr(random, "model_parallel_cuda_manual_seed", _copy(random.model_parallel_cuda_manual_seed))
    assert "no longer looks initialize_rng_tracker up" in seam_check.problems(caller)[0]


def test_changed_parameters_a_replaced_attribute_and_a_missing_one_are_named(monkeypatch):
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.moe import router

    monkeypatch.setattr(random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False,
                        stream=None: None)
    monkeypatch.setattr(mtp.MTPLossLoggingHelper, "tracker", [])
    monkeypatch.setattr(router.TopKRouter, "routing", lambda self, logits: logits)
    monkeypatch.delattr(mtp.MTPLossAutoScaler, "forward")
    found = {s.qualname: seam_check.problems(s) for s in SEAMS if s.loop == "core"}
    assert found["_get_cuda_rng_state"] == [
        "megatron.core.tensor_parallel.random._get_cuda_rng_state takes (device, clone, graph_safe, stream); "
        "snip-megatron was written for (device, clone, graph_safe)"]
    assert found["MTPLossLoggingHelper.tracker"] == [
        "megatron.core.transformer.multi_token_prediction.MTPLossLoggingHelper.tracker is a list, not a dict"]
    assert found["TopKRouter.router_replay"] == [
        "megatron.core.transformer.moe.router.TopKRouter.routing no longer reads .router_replay, so what SNIP "
        "puts there would never be used"]
    # torch.autograd.Function's own forward is inherited: it takes (*args, **kwargs)
    assert found["MTPLossAutoScaler.forward"][0].endswith(
        "MTPLossAutoScaler.forward takes (args, kwargs); snip-megatron was written for (ctx, output, mtp_loss)")
    with pytest.raises(RuntimeError, match=r"^snip-megatron cannot join this Megatron \(megatron-core [0-9.]+.*\) "
                                           r"safely: .*; .*tracker is a list.*; .*_get_cuda_rng_state takes "):
        seam_check.check("core")


def test_an_unknown_keyword_megatron_passes_to_forward_impl_is_named(monkeypatch):
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    def forward(self, input_):
        return self._forward_impl(input=input_, weight=self.weight, bias=None, fp8_output=True), None

    monkeypatch.setattr(RowParallelLinear, "forward", forward)
    row = next(s for s in SEAMS if s.qualname == "RowParallelLinear._forward_impl")
    assert seam_check.problems(row)[0].startswith(
        "RowParallelLinear._forward_impl: Megatron passes fp8_output, which SNIP's emulated linear does not know")


def test_the_command_line_prints_each_seam_and_fails_on_any(capsys, monkeypatch):
    assert seam_check.main(["--loop", "core"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("checking SNIP's seams against megatron-core ")
    assert "ok   core        megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl" in out
    assert out.rstrip().endswith(f"all {len(seams.of_loop('core'))} seams hold")
    from megatron.core.transformer import multi_token_prediction as mtp

    monkeypatch.setattr(mtp.MTPLossLoggingHelper, "tracker", None)
    assert seam_check.main(["--loop", "core"]) == 1
    out = capsys.readouterr().out
    assert "FAIL core        megatron.core.transformer.multi_token_prediction.MTPLossLoggingHelper.tracker\n" \
           "       megatron.core.transformer.multi_token_prediction.MTPLossLoggingHelper.tracker does not exist" in out
    assert out.rstrip().endswith(f"1 of {len(seams.of_loop('core'))} seams fail")


def test_a_megatron_imported_from_elsewhere_than_the_checkout_is_refused(capsys, tmp_path):
    assert seam_check.main(["--loop", "core", "--megatron-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"--megatron-root {tmp_path}: imported megatron.core from ") and "put the checkout first" in err
