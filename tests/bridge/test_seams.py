"""The one wrapped Bridge function: this Bridge's train_step has the parameters the wrapper was
written for (this test fails when a Bridge release changes them), a changed one is refused at
start-up naming it, and the wrapper passes through for a pretrain() without SNIP."""

import inspect

import pytest


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


def test_a_changed_train_step_is_refused_naming_it(monkeypatch):
    import megatron.bridge.training.train as btrain

    from snip_megatron.bridge.seams import check_seams

    def train_step(forward_step_func, data_iterators, model, optimizer, scheduler, global_state):
        raise AssertionError("never called")

    monkeypatch.setattr(btrain, "train_step", train_step)
    with pytest.raises(RuntimeError, match=r"megatron.bridge.training.train.train_step takes "
                                           r"\(forward_step_func, data_iterators, .*Megatron-Bridge"):
        check_seams()


def test_installed_wrapper_passes_through_without_a_snip_run(bridge_on_cpu):
    import megatron.bridge.training.train as btrain

    from snip_megatron.bridge import seams

    original = btrain.train_step
    seams.install()
    seams.install()  # once per process
    assert btrain.train_step is not original and btrain.train_step.__wrapped__ is original
    sentinel = object()

    class State:
        cfg = object()

    assert seams.step_begin(None, sentinel, [], None, State()) is sentinel
    seams.uninstall()
    assert btrain.train_step is original
