"""The run-time proof that Megatron-LM's loop goes through SNIP's seams (snip_megatron.pretrain.proof):
a training forward before SNIP's step hook, an interval save SNIP's wrapper never saw and a state
written where Megatron's tracker does not point each stop the run naming the seam and Megatron's
version; in one process, then in Megatron-LM's own loop with its caller of train_step (or of
save_checkpoint) bypassing SNIP's wrapper (prod lane)."""

import os

import pytest
import torch

from snip_megatron.pretrain.proof import RunProof
from snip_megatron.pretrain.state import STATE_FILE, TRACKER_FILE, iteration_folder

VERSION = r"\(megatron-core [0-9]+\.[0-9]+"


def test_a_training_forward_before_the_step_hook_stops_the_run(megatron_single):
    from snip_megatron.megatron.batch import random_batch
    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape

    model = build_gpt_model(shape)
    batch = random_batch(1, shape.seq_length, shape.vocab_size, torch.Generator().manual_seed(0))

    def forward():
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

    proof = RunProof()
    proof.arm()
    try:
        model.eval()
        forward()  # evaluation is no training step
        model.train()
        with pytest.raises(SystemExit, match=r"^SNIP: Megatron ran a training forward of GPTModel before SNIP's step "
                                             r"hook ever ran: its loop does not call SNIP's wrapper of "
                                             rf"megatron.training.training.train_step, .* {VERSION}"):
            forward()
        forward()  # said once: the hook is gone
        proof.arm()
        proof.step_begins(1)  # SNIP's step hook first: nothing to say, and nothing left armed
        forward()
        assert not torch.nn.modules.module._global_forward_pre_hooks
    finally:
        proof.disarm()


def test_an_interval_save_snip_never_saw_stops_the_next_step():
    proof = RunProof(save="ckpt", save_interval=2)
    proof.step_begins(5)  # resumed at iteration 4: that save was the last run's
    proof.saving(6)
    proof.step_begins(6)
    proof.step_begins(7)  # iteration 6 saved through SNIP
    proof.step_begins(8)
    with pytest.raises(SystemExit, match=r"^SNIP: Megatron saved iteration 8 \(--save-interval 2\) without SNIP's "
                                         r"wrapper of megatron.training.training.save_checkpoint, so that "
                                         rf"checkpoint has no snip_state.json .* {VERSION}"):
        proof.step_begins(9)
    RunProof(save=None, save_interval=2).step_begins(3)  # nothing saved: nothing to prove


def test_the_first_state_must_be_where_megatrons_tracker_points(tmp_path):
    iteration_folder(tmp_path, 4).mkdir()
    (iteration_folder(tmp_path, 4) / STATE_FILE).write_text("{}")
    (tmp_path / TRACKER_FILE).write_text("4")
    RunProof().state_written(4, str(tmp_path))
    (tmp_path / TRACKER_FILE).write_text("3")
    proof = RunProof()
    with pytest.raises(SystemExit, match=rf"after megatron.training.training.save_checkpoint saved iteration 4, "
                                         rf"Megatron's tracker .*{TRACKER_FILE} names 3 and .*{STATE_FILE} exists: a "
                                         "resumed run would not find SNIP's state"):
        proof.state_written(4, str(tmp_path))
    proof.state_written(4, str(tmp_path))  # the first save only


ARGS = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--vocab-size", "256", "--mock-data", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--lr", "1e-3", "--eval-iters", "1",
        "--eval-interval", "100", "--log-interval", "1", "--snip", "--snip-warmup", "1", "--snip-interval", "100",
        "--snip-lag", "1"]


@pytest.mark.launches
@pytest.mark.parametrize("bypassed, argv, words", [
    ("train_step", ["--train-iters", "2"],
     "SNIP: Megatron ran a training forward of GPTModel before SNIP's step hook ever ran: its loop does not call "
     "SNIP's wrapper of megatron.training.training.train_step"),
    ("save_checkpoint", ["--train-iters", "3", "--save", "{tmp}/ckpt", "--save-interval", "1"],
     "SNIP: Megatron saved iteration 1 (--save-interval 1) without SNIP's wrapper of "
     "megatron.training.training.save_checkpoint"),
])
def test_megatron_lms_loop_bypassing_a_wrapper_stops_naming_it(tmp_path, bypassed, argv, words):
    pytest.importorskip("megatron.training.training", reason="megatron.training ships only with megatron-core "
                                                              ">= 0.19 (prod lane)")
    from tests.distributed import ROOT, run_python
    from tests.forked import MEGATRON_LM

    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = run_python([ROOT / "tests" / "pretrain" / "bypass_worker.py", bypassed, *ARGS,
                       *[a.format(tmp=tmp_path) for a in argv]], cwd=tmp_path, env=env, timeout=420, check=False,
                      preload=MEGATRON_LM)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the stop is the last word but for "[snip] " notices: the step's plan may still be solving in
    # its thread, which the exit joins (its planner notice can follow)
    last = [line for line in proc.stderr.splitlines() if not line.startswith("[snip] ")][-1]
    assert words in last and "megatron-core 0." in last, proc.stderr[-3000:]
    assert " iteration        2/" not in proc.stdout  # stopped before a second step trained
