"""SNIP's state with Bridge's checkpoints: read before the model is built for the iteration Bridge
will load, taken again if Bridge loaded another one, and a run killed mid-way resumes with the
same plans at the same steps and the same losses as a run that was never stopped."""

import json

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.plan import Plan
from snip_megatron.pretrain.state import STATE_VERSION, write_state
from tests.bridge import tiny
from tests.bridge.runs import losses, worker


def snip_state(iteration: int, plan: Plan) -> dict:
    controller = {"version": 1, "plan": plan.to_dict(), "history": [], "smoothed_costs": None,
                  "next_measure": 100, "pending": None}
    return {"version": STATE_VERSION, "iteration": iteration, "plan": plan.to_dict(), "controller": controller}


def checkpoint(root, iteration, plan=None):
    (root / f"iter_{iteration:07d}").mkdir(parents=True)
    (root / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")  # an iteration folder
    if plan is not None:
        write_state(root, iteration, snip_state(iteration, plan))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_the_state_read_before_the_model_is_built_is_the_one_bridge_will_load(tmp_path):
    from types import SimpleNamespace

    from snip_megatron.bridge.state import expected_resume

    def ckpt(load, **kw):
        return SimpleNamespace(load=str(load) if load else None, ckpt_step=kw.get("ckpt_step"),
                               finetune=kw.get("finetune", False))

    assert expected_resume(ckpt(None)) == (None, None)
    assert expected_resume(ckpt(tmp_path)) == (None, None)  # nothing saved yet
    four, eight = Plan.uniform(2, "fp4"), Plan.uniform(2, "bf16")
    checkpoint(tmp_path, 4, four)
    checkpoint(tmp_path, 6)  # written without SNIP
    checkpoint(tmp_path, 8, eight)
    it, state = expected_resume(ckpt(tmp_path))
    assert it == 8 and Plan.from_dict(state["plan"]) == eight
    it, state = expected_resume(ckpt(tmp_path, ckpt_step=4))
    assert it == 4 and Plan.from_dict(state["plan"]) == four
    assert expected_resume(ckpt(tmp_path, ckpt_step=6)) == (6, None)
    assert expected_resume(ckpt(tmp_path, finetune=True)) == (None, None)  # a new run from the weights
    it, state = expected_resume(ckpt(tmp_path / "iter_0000004"))  # Bridge loads an iteration folder as is
    assert it == 4 and Plan.from_dict(state["plan"]) == four
    (tmp_path / "iter_0000008" / "snip_state.json").write_text("{torn")
    with pytest.raises(ValueError, match="iter_0000008/snip_state.json: the SNIP state .* cannot be read"):
        expected_resume(ckpt(tmp_path))


def test_a_load_of_another_iteration_takes_that_checkpoints_state(tmp_path):
    from snip_megatron.bridge.enable import prepare_run

    four, eight = Plan.uniform(2, "fp4"), Plan.uniform(2, "bf16")
    checkpoint(tmp_path, 4, four)
    checkpoint(tmp_path, 8, eight)
    cfg = tiny.tiny_config(load=str(tmp_path))
    cfg.model.vocab_size = 256  # Bridge sets it from the tokenizer before building the model
    run = prepare_run(cfg, SnipConfig(enabled=True))
    assert run.resumed_iteration == 8
    run.start(cfg.model)  # what the first chunk's layer spec does
    assert run.controller.plan == eight and run.controller.plan_source == "checkpoint"
    run.after_load(8)  # as expected: kept
    assert run.controller.plan == eight
    run.after_load(4)  # e.g. a newer tracker than the one read: iteration 4's state
    assert run.resumed_iteration == 4 and run.controller.plan == four
    run.after_load(None)  # weights only (pretrained_checkpoint): a fresh controller
    assert run.controller.plan == Plan.uniform(2, "fp8") and run.controller.plan_source == "initial fp8"


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    snip = {"warmup": 2, "interval": 3, "lag": 1, "fp4_budget": 0.5}
    common = ["--layers", "2", "--iters", "6", "--save-interval", "2"]
    whole = worker(tmp_path / "whole", *common, "--save", str(tmp_path / "a"), snip=snip)["ranks"][0]
    killed = worker(tmp_path / "killed", *common, "--save", str(tmp_path / "b"), "--kill-at", "4",
                    snip=snip, check=False)
    assert killed["returncode"] == 17 and not killed["ranks"]  # died at step 4, before any report
    assert sorted(p.name for p in (tmp_path / "b").glob("iter_*")) == ["iter_0000002"]
    saved = json.loads((tmp_path / "b" / "iter_0000002" / "snip_state.json").read_text())
    # Measured at step 2, applied at 3: the checkpoint of step 2 carries the solved, pending plan.
    assert saved["controller"]["pending"]["apply_step"] == 3 and saved["controller"]["pending"]["plan"]
    resumed = worker(tmp_path / "resumed", *common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"),
                     snip=snip)
    resumed_rank = resumed["ranks"][0]
    assert resumed_rank["plan_source"] == "checkpoint"
    assert "Starting training loop at iteration 2" in resumed["stdout"]
    assert [(h["step"], h["event"]) for h in whole["history"]] == [(0, "initial"), (3, "update"), (6, "update")]
    assert resumed_rank["history"] == whole["history"]  # the same plans at the same steps
    assert resumed_rank["plan"] == whole["plan"] and resumed_rank["local_plan"] == whole["local_plan"]
    expected = {int(k): v for k, v in whole["losses"].items() if int(k) > 2}
    got = {int(k): v for k, v in resumed_rank["losses"].items()}
    assert sorted(got) == [3, 4, 5, 6]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-6), step
    assert losses(resumed) == got
