import json
import math

import pytest
import torch

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.hooks import StepHook
from snip_megatron.plan import Plan
from snip_megatron.train.loop import Trainer


def run(config, hooks=()):
    trainer = Trainer(config, hooks)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return trainer, history


def test_short_run_on_default_corpus_lowers_validation_loss(tiny_config, tmp_path):
    metrics = tmp_path / "m.jsonl"
    config = tiny_config(steps=60, micro_batch_size=8, lr=1e-2, min_lr=1e-3, warmup_steps=6,
                         eval_interval=30, metrics_path=str(metrics))
    trainer, history = run(config)
    vals = [m["val_loss"] for m in history if "val_loss" in m]
    assert len(vals) == 3  # before training, step 30, step 60
    assert vals[0] > 0.95 * math.log(1024)  # starts near uniform over the vocabulary
    assert vals[-1] < vals[0] - 1.0, vals  # measured: 6.94 -> 5.70
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(61))
    steps = lines[1:]
    assert all(m["tokens_per_s"] > 0 and math.isfinite(m["loss"]) for m in steps)
    # Warm-up to the peak, then cosine decay to min_lr.
    lrs = [m["lr"] for m in steps]
    assert lrs[0] < lrs[5] == pytest.approx(config.lr) and lrs[-1] == pytest.approx(config.min_lr)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))


class Recorder(StepHook):
    name = "recorder"

    def __init__(self, extra_pass=False):
        self.starts, self.ends, self.extra_losses = [], [], []
        self.extra_pass = extra_pass
        self.loaded = None

    def on_step_start(self, trainer, step):
        assert trainer.current_batch and trainer.step == step - 1
        self.starts.append(step)
        if self.extra_pass:  # a measurement pass: gradients, but no optimizer step
            self.extra_losses.append(trainer.forward_backward())

    def on_step_end(self, trainer, step, metrics):
        self.ends.append((step, metrics["loss"]))

    def state_dict(self):
        return {"ends": [s for s, _ in self.ends]}

    def load_state_dict(self, state):
        self.loaded = state


def test_hooks_see_every_step_and_extra_passes_do_not_change_training(tiny_config):
    plain, _ = run(tiny_config(steps=3), [Recorder()])
    hook = Recorder(extra_pass=True)
    run(tiny_config(steps=3), [hook])
    assert hook.starts == [1, 2, 3] and [s for s, _ in hook.ends] == [1, 2, 3]
    # The extra pass sees the same batch and weights as the real step, and leaves no trace.
    assert [l for _, l in hook.ends] == pytest.approx(hook.extra_losses, rel=1e-6)
    assert [l for _, l in hook.ends] == pytest.approx([l for _, l in plain.hooks[0].ends], rel=1e-6)


def test_plan_reaches_every_planned_linear(tiny_config):
    from snip_megatron.megatron.apply import current_plan

    trainer = Trainer(tiny_config(precision="fp8"))
    try:
        assert set(current_plan(trainer.chunks).values()) == {Precision.FP8}
        plan = Plan.uniform(2, "fp4")
        trainer.set_plan(plan)
        assert current_plan(trainer.chunks) == plan == trainer.plan
        trainer.current_batch = trainer.reader.take(1)
        assert math.isfinite(trainer.forward_backward())
        with pytest.raises(ValueError, match="layers"):
            trainer.set_plan(Plan.uniform(3, "fp4"))
    finally:
        trainer.close()


def test_plans_run_in_the_configured_formats(tiny_config):
    from snip_megatron.stats.discover import planned_linears

    trainer = Trainer(tiny_config(precision="fp4", formats=Formats(fp4_recipe="mxfp4", fp8_recipe="mxfp8")))
    try:
        assert {m.format_spec.recipe for _, m in planned_linears(trainer.chunks)} == {"mxfp4"}
        trainer.set_plan(Plan.uniform(2, "fp8"))
        assert {m.format_spec.recipe for _, m in planned_linears(trainer.chunks)} == {"mxfp8"}
    finally:
        trainer.close()


def test_checkpoint_resume_gives_the_same_next_step_loss(tiny_config, tmp_path):
    ckpt = tmp_path / "ckpt"
    hook = Recorder()
    full, history = run(tiny_config(steps=4, precision="fp8", save_dir=str(ckpt), save_interval=3), [hook])
    resumed_hook = Recorder()
    resumed, resumed_history = run(tiny_config(steps=4, precision="fp8", load_dir=str(ckpt), load_step=3),
                                   [resumed_hook])
    assert [m["step"] for m in resumed_history] == [4]
    assert resumed_history[0]["loss"] == pytest.approx(history[3]["loss"], rel=1e-6)
    assert resumed_hook.loaded == {"ends": [1, 2, 3]}  # hook state came back from the checkpoint
    assert resumed.consumed_train_samples == full.consumed_train_samples
    assert resumed.plan == Plan.uniform(2, "fp8")


def measuring_controller(cfg, run_dir):
    """SNIP's controller on `cfg`'s model: its initial plan, then one measured re-plan at step 2."""
    from snip_megatron.config import SnipConfig
    from snip_megatron.controller import SnipController

    return SnipController(SnipConfig(enabled=True, warmup=2, interval=10, lag=0, fp4_budget=0.5), cfg.shape,
                          total_steps=cfg.steps, run_dir=run_dir, inventory=cfg.inventory,
                          tokens_per_step=cfg.micro_batch_size * cfg.seq_len, log=lambda m: None)


def replan_save_and_resume(config, tmp_path):
    """Four steps of `config(...)` with SNIP (its initial plan, a measured re-plan), saved at step 3 and
    resumed from there: the resumed run starts with the same plan and the same next-step loss.
    Returns the first run's trainer."""
    ckpt = tmp_path / "ckpt"
    cfg = config(steps=4, save_dir=str(ckpt), save_interval=3)
    snip = measuring_controller(cfg, tmp_path / "run")
    trainer, history = run(cfg, [snip])
    assert [h["event"] for h in snip.history] == ["initial", "update"]
    resumed_cfg = config(steps=4, load_dir=str(ckpt), load_step=3)
    resumed, resumed_history = run(resumed_cfg, [measuring_controller(resumed_cfg, tmp_path / "run")])
    assert resumed.plan == trainer.plan
    assert resumed_history[0]["loss"] == pytest.approx(history[3]["loss"], rel=1e-6)
    return trainer


@pytest.mark.compat
def test_multi_latent_attention_measures_replans_and_resumes(tiny_config, tmp_path):
    """The attention of the llama_tiny_mla preset (TrainConfig.mla) on the tiny model: SNIP's controller
    measures every MLA linear (the down-projections duplicated over TP, as Megatron's TE spec builds
    them), re-plans them, and the checkpoint resumes with that plan and the same next-step loss.
    On megatron-core 0.16 without TE (the compat lane) MLA cannot be built: refused, naming why."""
    import dataclasses

    from snip_megatron.megatron.apply import megatron_core_version
    from snip_megatron.megatron.model import make_transformer_config, te_importable
    from snip_megatron.models.gpt import PRESET_MLA
    from snip_megatron.shapes import get_shape

    if megatron_core_version() < (0, 17) and not te_importable():
        with pytest.raises(ValueError, match=r"multi-latent attention on megatron-core < 0.17 needs Transformer "
                                             r"Engine"):
            make_transformer_config(get_shape("llama_tiny_mla"), mla=PRESET_MLA["llama_tiny_mla"])
        return

    from snip_megatron.megatron.mla import QuantDownProjection
    from tests.train.conftest import TINY

    assert tiny_config(model="llama_tiny_mla").mla == PRESET_MLA["llama_tiny_mla"]  # the preset's attention
    mla = dataclasses.replace(PRESET_MLA["llama_tiny_mla"], q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
                              v_head_dim=16)

    def config(**kw):
        return tiny_config(model=TINY.with_(num_query_groups=4), mla=mla, precision="fp8", **kw)

    trainer = replan_save_and_resume(config, tmp_path)
    names = ["linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj",
             "linear_fc1", "linear_fc2"]
    assert [k.name for k in trainer.plan.keys()] == names * 2 and trainer.plan.counts()["fp4"] > 0
    downs = [m for m in trainer.modules[0].modules() if isinstance(m, QuantDownProjection)]
    assert len(downs) == 4  # q and kv down-projections of both layers


@pytest.mark.compat
def test_moe_measures_replans_and_resumes(tiny_config, tmp_path):
    """The experts of the llama_tiny_moe preset (TrainConfig.moe) on the tiny model, layer 1 MoE and
    layer 2 dense: SNIP's controller measures the routed-expert units (routing frozen across its
    passes), re-plans them, and the checkpoint resumes with that plan and the same next-step loss."""
    import dataclasses

    from snip_megatron.models.gpt import PRESET_MOE
    from tests.train.conftest import TINY

    assert tiny_config(model="llama_tiny_moe").moe == PRESET_MOE["llama_tiny_moe"]  # the preset's experts
    moe = dataclasses.replace(PRESET_MOE["llama_tiny_moe"], ffn_hidden_size=32)

    def config(**kw):
        return tiny_config(model=TINY, moe=moe, precision="fp8", **kw)

    trainer = replan_save_and_resume(config, tmp_path)
    assert [k.name for k in trainer.plan.keys()] == ["linear_qkv", "linear_proj", "expert_fc1", "expert_fc2",
                                                     "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert trainer.plan.counts()["fp4"] > 0


def test_missing_or_truncated_checkpoint_raises_and_overwrites_nothing(tiny_config, tmp_path):
    from snip_megatron.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint to load"):
        Trainer(tiny_config(load_dir=str(tmp_path / "nothing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint to load in"):
        Trainer(tiny_config(load_dir=str(tmp_path / "empty")))

    ckpt = tmp_path / "ckpt"
    run(tiny_config(steps=2, save_dir=str(ckpt), save_interval=1))
    with pytest.raises(CheckpointError, match="no checkpoint for step 7 .* saved steps: \\[1, 2\\]"):
        Trainer(tiny_config(load_dir=str(ckpt), load_step=7))
    shard = max((ckpt / "iter_0000002").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="truncated"):
        Trainer(tiny_config(steps=4, load_dir=str(ckpt), save_dir=str(ckpt), save_interval=1))
    after = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.rglob("*") if p.is_file()}
    assert after == before


def test_saving_twice_to_the_same_step_is_safe(tiny_config, tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer = Trainer(tiny_config(steps=2))
    try:
        trainer.fit()
        trainer.save(ckpt)
        trainer.save(ckpt)
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        weights = [p.detach().clone() for p in trainer.modules[0].parameters()]
    finally:
        trainer.close()
    resumed = Trainer(tiny_config(steps=2, load_dir=str(ckpt)))
    try:
        assert resumed.step == 2
        for a, b in zip(weights, resumed.modules[0].parameters()):
            assert torch.equal(a, b)
    finally:
        resumed.close()


def test_a_hook_planning_another_model_is_refused_at_start_up(tiny_config):
    """The loop agrees on its built model's inventory (every rank, one all-gather) and checks each
    hook's against it: a controller planning another model stops the run before any step."""
    from snip_megatron.models import gpt

    class Planner(StepHook):
        name = "planner"

    planner = Planner()
    config = tiny_config()
    planner.inventory = gpt.inventory(config.shape.with_(num_layers=config.shape.num_layers + 1))
    with pytest.raises(ValueError, match=r"^gpt inventory does not match the model the loop built \(hook "
                                         r"'planner' plans another\): 4 linear\(s\) missing"):
        Trainer(config, [planner])
