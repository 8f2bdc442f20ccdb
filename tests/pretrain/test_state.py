"""snip_state.json: the iteration Megatron loads (tracker, --ckpt-step, --finetune), round trip,
and a corrupt or foreign file refused with its name."""

import json
from types import SimpleNamespace

import pytest

from snip_megatron.pretrain.state import (STATE_FILE, STATE_VERSION, iteration_folder, loaded_iteration,
                                          read_state, write_state)


def args(load, **kw):
    return SimpleNamespace(load=str(load) if load else None, ckpt_step=kw.get("ckpt_step"),
                           finetune=kw.get("finetune", False))


def test_the_loaded_iteration_is_megatrons(tmp_path):
    assert loaded_iteration(args(None)) is None
    assert loaded_iteration(args(tmp_path)) is None  # no checkpoint yet
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8\n")
    assert loaded_iteration(args(tmp_path)) == 8
    assert loaded_iteration(args(tmp_path, ckpt_step=4)) == 4  # --ckpt-step wins over the tracker
    assert loaded_iteration(args(tmp_path, finetune=True)) is None  # --finetune starts a new run
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert loaded_iteration(args(tmp_path)) == "release"
    assert iteration_folder(tmp_path, "release") == tmp_path / "release"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("eight")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt: Megatron's checkpoint tracker"):
        loaded_iteration(args(tmp_path))


def test_state_of_the_loaded_iteration_round_trips(tmp_path):
    state4 = {"version": STATE_VERSION, "iteration": 4, "plan": {"1.linear_qkv": "fp8"}}
    state8 = {**state4, "iteration": 8}
    assert write_state(tmp_path, 4, state4) == tmp_path / "iter_0000004" / STATE_FILE
    write_state(tmp_path, 8, state8)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8")
    assert read_state(args(tmp_path)) == state8
    assert read_state(args(tmp_path, ckpt_step=4)) == state4
    assert read_state(args(tmp_path, ckpt_step=6)) is None  # a checkpoint written without SNIP


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot be read"),
    (json.dumps({"version": 99}), "not a SNIP state of version 1"),
    (json.dumps([1, 2]), "not a SNIP state"),
])
def test_a_bad_state_file_is_refused_naming_it(tmp_path, text, message):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / STATE_FILE).write_text(text)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(ValueError, match=f"iter_0000002/{STATE_FILE}: .*{message}"):
        read_state(args(tmp_path))
