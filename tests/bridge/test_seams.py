"""The wrapped Bridge functions (train_step, and GPTModelProvider's mtp_block_spec): this Bridge's
have the parameters the wrappers were written for (this test fails when a Bridge release changes
them), a changed one is refused at start-up naming it, and the wrappers pass through for a
pretrain() without SNIP."""

import inspect

import pytest

from tests.bridge import tiny


def test_bridges_train_step_takes_what_the_wrapper_relies_on():
    import megatron.bridge.training.train as btrain

    from snip_megatron.bridge.seams import MODULE, WRAPPED, check_seams

    check_seams()
    expected = WRAPPED[(MODULE, "train_step")]
    assert tuple(inspect.signature(btrain.train_step).parameters)[:len(expected)] == expected
    # train() calls it positionally with these leading arguments (the wrapper's contract).
    source = inspect.getsource(btrain.train)
    assert "wrapped_train_step = train_step" in source
    assert ("wrapped_forward_step_func,\n            train_data_iterator,\n            model,\n            optimizer,"
            "\n            scheduler,\n            global_state,") in source
    # GPTModelProvider.provide looks mtp_block_spec up in its module for every chunk it builds.
    from megatron.bridge.models import gpt_provider

    provide = inspect.getsource(gpt_provider.GPTModelProvider.provide)
    assert "mtp_block_spec=mtp_block_spec(self, vp_stage=vp_stage)" in provide


def test_a_changed_train_step_is_refused_naming_it(monkeypatch):
    import megatron.bridge.training.train as btrain

    from snip_megatron.bridge.seams import check_seams

    def train_step(forward_step_func, data_iterators, model, optimizer, scheduler, global_state):
        raise AssertionError("never called")

    monkeypatch.setattr(btrain, "train_step", train_step)
    with pytest.raises(RuntimeError, match=r"^snip-megatron cannot join this Megatron-Bridge \(megatron-core .*, "
                                           r"megatron-bridge .*\) safely: megatron.bridge.training.train.train_step "
                                           r"takes \(forward_step_func, data_iterators, "):
        check_seams()


def test_installed_wrapper_passes_through_without_a_snip_run(bridge_on_cpu):
    import megatron.bridge.training.train as btrain

    from snip_megatron.bridge import seams

    from megatron.bridge.models import gpt_provider

    original, original_mtp = btrain.train_step, gpt_provider.mtp_block_spec
    seams.install()
    seams.install()  # once per process
    assert btrain.train_step is not original and btrain.train_step.__wrapped__ is original
    assert gpt_provider.mtp_block_spec.__wrapped__ is original_mtp
    assert gpt_provider.mtp_block_spec(tiny.tiny_config().model) is None  # no SNIP run, no MTP: Bridge's answer
    sentinel = object()

    class State:
        cfg = object()

    assert seams.step_begin(None, sentinel, [], None, State()) is sentinel
    seams.uninstall()
    assert btrain.train_step is original and gpt_provider.mtp_block_spec is original_mtp
