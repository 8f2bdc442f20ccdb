"""enable_snip in Bridge's own pretrain() on CPU: the real controller measures, the ILP (CBC)
re-plans, every chunk's linears run that plan, and its state is written after each checkpoint;
the checks enable_snip makes before Bridge starts."""

import json
import math

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.plan import Plan
from tests.bridge import tiny


MLA_LINEARS = ["linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj",
               "linear_fc1", "linear_fc2"]


def test_a_short_run_replans_and_every_linear_runs_the_ilps_plan(bridge_on_cpu, tmp_path):
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from snip_megatron.bridge import enable_snip
    from snip_megatron.bridge.model import SnipLayerSpec
    from snip_megatron.bridge.run import active
    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear, QuantRowParallelLinear
    from snip_megatron.megatron.apply import current_plan, list_planned_linears

    ckpt = tmp_path / "ckpt"
    cfg = tiny.tiny_config(num_layers=2, iters=4, save=str(ckpt), save_interval=4)
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")  # Bridge's own writer gets SNIP's figures
    snip = SnipConfig(enabled=True, warmup=2, interval=10, lag=0, fp4_budget=0.5)
    record = tiny.recorder()
    callbacks = enable_snip(cfg, snip)
    assert isinstance(cfg.model.transformer_layer_spec, SnipLayerSpec)
    run = active(cfg)
    pretrain(cfg, forward_step, callbacks=callbacks + [record])

    controller = run.controller
    assert [h["event"] for h in controller.history] == ["initial", "update"]
    assert controller.history[1]["step"] == 2  # measured on step 2's batch, applied before it trained (lag 0)
    assert controller.plan != Plan.uniform(2, "fp8") and controller.plan.counts()["fp4"] > 0
    # The ILP's plan reached every planned linear of every chunk.
    planned = list_planned_linears(record.model)
    assert len(planned) == 8
    assert all(isinstance(pl.module, (QuantColumnParallelLinear, QuantRowParallelLinear)) for pl in planned)
    assert current_plan(record.model) == controller.plan
    rows = [json.loads(line) for line in (ckpt / "snip_plans.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["solver"] == "cbc" and rows[-1]["status"] == "optimal"
    assert rows[-1]["fp4_fraction"] >= 0.5  # the budget
    # SNIP's state beside Bridge's checkpoint of iteration 4, with the plan now running.
    state = json.loads((ckpt / "iter_0000004" / "snip_state.json").read_text())
    assert state["iteration"] == 4 and Plan.from_dict(state["plan"]) == controller.plan
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(record.losses) == [1, 2, 3, 4] and all(math.isfinite(x) for x in record.losses.values())
    assert active() is None  # on_train_end: the process has no SNIP run any more
    # SNIP's figures in Bridge's TensorBoard folder, read back with TensorBoard's event reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0}).Reload()
    steps = [h["step"] for h in controller.history]
    assert [e.step for e in events.Scalars("snip/flops_fp4")] == steps
    assert events.Scalars("snip/flops_fp4")[-1].value >= 0.5
    assert [e.step for e in events.Scalars("snip/predicted_cost")] == [2]
    assert [e.step for e in events.Images("snip/plan_heatmap")] == steps
    assert events.Tensors("snip/plan_table/text_summary")[-1].tensor_proto.string_val[0].decode().count("\n") == 9


def _pretrain_replanning_at_step_2(cfg):
    """Bridge's pretrain() of `cfg` with SNIP on (measured at step 2, no later re-plan): its
    controller and the tiny.recorder of the run."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from snip_megatron.bridge import enable_snip
    from snip_megatron.bridge.run import active

    snip = SnipConfig(enabled=True, warmup=2, interval=10, lag=0, fp4_budget=0.5)
    record = tiny.recorder()
    callbacks = enable_snip(cfg, snip)
    run = active(cfg)
    pretrain(cfg, forward_step, callbacks=callbacks + [record])
    return run.controller, record


def test_multi_latent_attention_and_multi_token_prediction_replan_through_bridge(bridge_on_cpu, tmp_path, capsys):
    """Bridge's MLAModelProvider with q_lora_rank and one MTP layer, on SNIP's emulated linears: every
    MLA linear (down-projections duplicated over TP, as Megatron's TE spec builds them) and the MTP
    layer's, keyed "mtp.<name>" by depth and never FP4 (as Megatron), are measured and re-planned."""
    from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear, QuantRowParallelLinear
    from snip_megatron.megatron.apply import current_plan, list_planned_linears
    from snip_megatron.megatron.mla import LocalMLACore, QuantDownProjection

    cfg = tiny.tiny_mla_config(num_layers=2, iters=3)
    controller, record = _pretrain_replanning_at_step_2(cfg)
    assert [h["event"] for h in controller.history] == ["initial", "update"]
    mtp = ["mtp.eh_proj"] + ["mtp." + n for n in MLA_LINEARS]
    plan = controller.plan
    assert sorted({k.name for k in plan.keys()}) == sorted(MLA_LINEARS + mtp) and len(plan) == 2 * 7 + 8
    assert plan.counts()["fp4"] > 0  # the re-plan put some MLA linears in FP4 ...
    assert {p.value for k, p in plan.items() if k.name.startswith("mtp.")} <= {"bf16", "fp8"}  # ... no MTP one
    assert "[snip] 8 multi-token-prediction linears planned in BF16/FP8, never FP4" in capsys.readouterr().out
    planned = list_planned_linears(record.model)
    assert len(planned) == 22 and current_plan(record.model) == plan
    assert all(isinstance(pl.module, (QuantColumnParallelLinear, QuantRowParallelLinear, QuantDownProjection))
               for pl in planned)
    assert {type(pl.module) for pl in planned if pl.key.name.endswith("down_proj")} == {QuantDownProjection}
    assert any(isinstance(m, LocalMLACore) for m in record.model[0].modules())
    assert sorted(record.losses) == [1, 2, 3] and all(math.isfinite(x) for x in record.losses.values())


def test_a_tiny_qwen3_moe_measures_and_replans_through_bridge(bridge_on_cpu, capsys):
    """A tiny Qwen3-MoE (tiny.QWEN3_MOE: 4 experts, top-2, every layer MoE, aux loss) on SNIP's emulated
    linears at one process: each layer's routed experts are one planned unit per linear
    (expert_fc1/expert_fc2, SequentialMLP's local experts switched together), the router never
    planned; measured with routing frozen, re-planned, and every expert runs its unit's plan."""
    from snip_megatron.megatron.apply import current_plan, list_planned_linears

    cfg = tiny.tiny_moe_config(num_layers=2, iters=3)
    controller, record = _pretrain_replanning_at_step_2(cfg)
    assert [h["event"] for h in controller.history] == ["initial", "update"]
    plan = controller.plan
    assert [str(k) for k in plan.keys()] == [f"{i}.{n}" for i in (1, 2) for n in
                                             ("linear_qkv", "linear_proj", "expert_fc1", "expert_fc2")]
    assert plan.counts()["fp4"] > 0
    notice = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[snip] MoE: ")]
    assert notice and notice[0].startswith("[snip] MoE: 4 routed-expert units planned") and "mlp.router" in notice[0]
    planned = list_planned_linears(record.model)
    assert len(planned) == 2 * (2 + 2 * 4)  # attention's two linears and 4 experts' two per layer
    assert current_plan(record.model) == plan
    assert sorted(record.losses) == [1, 2, 3] and tiny.finite(record.losses.values())


def test_a_tiny_qwen3_moe_under_full_recompute_measures_and_replans(bridge_on_cpu):
    """The tiny Qwen3-MoE with every layer recomputed (routing replayed in the recompute as in the
    measurement's passes): measured, re-planned, and every expert runs its unit's plan."""
    from snip_megatron.megatron.apply import current_plan, list_planned_linears

    cfg = tiny.tiny_moe_config(num_layers=2, iters=3)
    cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "uniform", 1
    controller, record = _pretrain_replanning_at_step_2(cfg)
    assert [(h["step"], h["event"]) for h in controller.history] == [(0, "initial"), (2, "update")]
    assert controller.plan.counts()["fp4"] > 0 and current_plan(record.model) == controller.plan
    assert len(list_planned_linears(record.model)) == 2 * (2 + 2 * 4)
    assert sorted(record.losses) == [1, 2, 3] and tiny.finite(record.losses.values())


def test_a_hybrid_model_replans_through_hybrid_model_provider_over_the_te_double(tmp_path):
    """Bridge's HybridModelProvider with '*-*-' (attention, MLP, attention, MLP layers), whose stack spec
    is Transformer Engine's only, over the TE double standing in for an H100 (a process of its own):
    SNIP plans its TE linears keyed by hybrid layer, measures, re-plans under Hopper's FP8 budget,
    and every linear runs the controller's plan."""
    from tests.bridge.runs import losses, worker
    from tests.te.te_versions import double_pythonpath

    env = {"PYTHONPATH": double_pythonpath(apex=True), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"}
    result = worker(tmp_path / "hybrid", "--hybrid", "*-*-", "--iters", "3", env=env,
                    snip={"warmup": 2, "interval": 10, "lag": 0})
    assert "[snip] on; backend te; formats fp8=blockwise(pow2); plan: initial fp8" in result["stdout"]
    rank = result["ranks"][0]
    assert [h["event"] for h in rank["history"]] == ["initial", "update"] and rank["history"][1]["step"] == 2
    assert sorted(rank["plan"]) == sorted(["1.linear_qkv", "1.linear_proj", "2.linear_fc1", "2.linear_fc2",
                                           "3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"])
    assert "bf16" in rank["plan"].values() and set(rank["plan"].values()) <= {"bf16", "fp8"}  # Hopper: no FP4
    assert rank["local_plan"] == rank["plan"]  # every TE linear runs the re-plan
    assert sorted(losses(result)) == [1, 2, 3] and all(math.isfinite(x) for x in losses(result).values())


def test_a_hybrid_models_inventory_has_its_moe_layers_experts():
    """A HybridModelProvider's E layers are planned as the GPT adapter's routed-expert units (trained
    through Bridge in tests/bridge/test_layouts.py; snip-analyze reads this inventory too)."""
    from snip_megatron.bridge.run import planned_inventory

    cfg = tiny.tiny_hybrid_config("*E*-")
    cfg.model.num_moe_experts, cfg.model.moe_router_topk, cfg.model.moe_ffn_hidden_size = 4, 2, 32
    inventory = planned_inventory(cfg.model)
    assert [str(e.key) for e in inventory] == ["1.linear_qkv", "1.linear_proj", "2.expert_fc1", "2.expert_fc2",
                                               "3.linear_qkv", "3.linear_proj", "4.linear_fc1", "4.linear_fc2"]
    assert [(e.shape, e.experts, e.topk) for e in inventory if e.layer == 2] == [((64, 64), 4, 2), ((64, 32), 4, 2)]


def test_disabled_snip_changes_nothing():
    from snip_megatron.bridge import enable_snip

    cfg = tiny.tiny_config()
    spec = cfg.model.transformer_layer_spec
    assert enable_snip(cfg, SnipConfig(enabled=False)) == []
    assert cfg.model.transformer_layer_spec is spec and cfg.checkpoint.custom_manager_class is None


def test_checks_against_the_run_before_bridge_starts(tmp_path):
    from snip_megatron.bridge.enable import prepare_run

    with pytest.raises(ValueError, match=r"fraction of the run.*train_iters=None \(Bridge's train.train_iters\)"):
        cfg = tiny.tiny_config()
        cfg.train.train_iters = None
        prepare_run(cfg, SnipConfig(enabled=True, warmup=0.2))
    Plan.uniform(3, "fp8").save(tmp_path / "plan.json")
    with pytest.raises(ValueError, match="layer"):  # a 3-layer plan for a 2-layer model
        prepare_run(tiny.tiny_config(num_layers=2), SnipConfig(enabled=True, plan=str(tmp_path / "plan.json")))
    with pytest.raises(ValueError, match="needs a SnipConfig"):
        from snip_megatron.bridge import enable_snip

        enable_snip(tiny.tiny_config(), {"fp4_budget": 0.5})


def test_a_user_quant_recipe_may_not_set_planned_linears():
    from megatron.core.quantization.quant_config import GlobMatcher, RecipeConfig

    from snip_megatron.bridge.enable import prepare_run

    cfg = tiny.tiny_config()
    cfg.model.quant_recipe = RecipeConfig([GlobMatcher("*linear_fc1", "mine")], {"mine": {}})
    with pytest.raises(ValueError, match=r"model.quant_recipe sets decoder.layers.0.mlp.linear_fc1"):
        prepare_run(cfg, SnipConfig(enabled=True))
    cfg.model.quant_recipe = RecipeConfig([GlobMatcher("*output_layer", "mine")], {"mine": {}})
    run = prepare_run(cfg, SnipConfig(enabled=True))
    assert run.user_recipe is cfg.model.quant_recipe  # kept: merged after SNIP's matchers


def test_called_twice_is_refused(bridge_on_cpu):
    from snip_megatron.bridge import enable_snip

    cfg = tiny.tiny_config()
    enable_snip(cfg, SnipConfig(enabled=True))
    with pytest.raises(ValueError, match="already called on this config"):
        enable_snip(cfg, SnipConfig(enabled=True))
