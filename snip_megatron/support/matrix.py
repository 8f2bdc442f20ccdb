"""The support matrix as data: the axes (entries, model shapes, backends, layout classes, each with
the settings that make it), the runs the tests make (TESTED) and what an entry cannot express
(UNREACHABLE). What is refused is not written here: the rules (support.rules) say it, evaluated on
each cell's settings (support.cells). docs/support.md is generated from this (support.doc).

A layout class names what a run adds to one process; real runs combine them, and a tested run
names every class it combines. TP on the emulated backend runs without sequence parallelism (the
local spec's torch norms refuse it); on Transformer Engine with it.
"""

from __future__ import annotations

from dataclasses import dataclass

ENTRIES = {
    "megatron-lm": "Megatron-LM's loop: snip-pretrain-gpt / snip-pretrain-hybrid, a patched pretrain_gpt.py / "
                   "pretrain_hybrid.py",
    "bridge": "Megatron-Bridge: enable_snip in a recipe's pretrain(), snip-bridge-pretrain",
    "compact": "the compact loop: python -m snip_megatron.train, snip-train train.entry=compact",
    "analyze": "snip-analyze on a checkpoint of the run (plans at several budgets, their YAMLs)",
    "export": "python -m snip_megatron.report export (a run's plan as Megatron/Bridge/TE recipe YAML)",
}
MOE = {"model.num_moe_experts": 8, "model.moe_router_topk": 2, "model.moe_ffn_hidden_size": 512}
MODELS = {
    "dense": ("dense GPT (Llama-like)", {}),
    "mla": ("multi-latent attention (DeepSeek-style)", {"model.multi_latent_attention": True,
                                                        "model.kv_lora_rank": 512}),
    "mtp": ("multi-token prediction", {"model.mtp_num_layers": 1}),
    "moe_local": ("MoE, SequentialMLP experts (local spec)", MOE),
    "moe_te_grouped": ("MoE, TE grouped experts", {**MOE, "model.moe_grouped_gemm": True}),
    "hybrid": ("HybridModel, attention and MLP layers ('*-*-')", {"run.family": "hybrid",
                                                                  "run.hybrid_pattern": "*-*-"}),
    "hybrid_moe": ("HybridModel with MoE layers ('*EE*')", {"run.family": "hybrid", "run.hybrid_pattern": "*EE*",
                                                            **MOE, "model.moe_grouped_gemm": True}),
    "hybrid_ssm": ("HybridModel with Mamba / GDN layers ('M*M*')", {"run.family": "hybrid",
                                                                    "run.hybrid_pattern": "M*M*"}),
}
TE = {"model.transformer_impl": "transformer_engine", "run.backend": "te", "run.te_installed": True}
BACKENDS = {
    "emulated": ("SNIP's emulated linears (--transformer-impl local), any device", {}),
    "te_hopper": ("Transformer Engine on Hopper (SM90): BF16/FP8", {**TE, "snip.precisions": ("bf16", "fp8")}),
    "te_blackwell": ("Transformer Engine on Blackwell (SM100): FP8/FP4", {**TE, "snip.precisions": ("fp8", "fp4")}),
}
TWO = {"run.world_size": 2}
LAYOUTS = {
    "one": ("1 process", {}),
    "tp": ("TP=2 (with SP on TE)", {"model.tensor_model_parallel_size": 2, **TWO}),
    "pp": ("PP=2", {"model.pipeline_model_parallel_size": 2, **TWO}),
    "vpp": ("PP=2 x VPP=2", {"model.pipeline_model_parallel_size": 2,
                             "model.virtual_pipeline_model_parallel_size": 2, **TWO}),
    "dp": ("DP=2, distributed optimizer", {"ddp.use_distributed_optimizer": True, **TWO}),
    "ep": ("EP=2", {"model.expert_model_parallel_size": 2, **TWO}),
    "etp": ("expert TP=2", {"model.expert_tensor_parallel_size": 2, **TWO}),
    "cp": ("CP=2", {"model.context_parallel_size": 2, **TWO}),
    "recompute": ("full recompute", {"model.recompute_granularity": "full"}),
}


@dataclass(frozen=True)
class Run:
    """A test that runs an entry with SNIP on, measuring and re-planning (analyze: measuring and
    writing plans; export: recipes Megatron's parser loads)."""

    entry: str
    models: tuple[str, ...]
    backend: str
    layouts: tuple[str, ...]
    """The layout classes the run combines (("one",): one process)."""
    test: str
    """The pytest node id."""


def _runs(entry, models, backend, *rows) -> tuple[Run, ...]:
    return tuple(Run(entry, tuple(models.split("+")), backend, tuple(layouts.split("+")), test)
                 for layouts, test in rows)


PRETRAIN = "tests/pretrain/"
LAYOUT = PRETRAIN + "test_layouts.py::"
MOE_LAYOUT = PRETRAIN + "test_moe_layouts.py::"
DEEPSEEK = PRETRAIN + "test_deepseek_runs.py::"
GENERATIONS = (("te_hopper", 90), ("te_blackwell", 100))
BRIDGE_LAYOUT = "tests/bridge/test_layouts.py::"
BRIDGE_CHAIN = BRIDGE_LAYOUT + "test_te_chains_across_layouts_and_generations"
BRIDGE_CLI_MOE = "tests/bridge/test_cli.py::test_moe_recipes_at_ep2_resumed_at_pp2_through_the_command"
EXPORT_CELL = "tests/test_export_shapes.py::test_every_cell_exports_each_stages_planned_modules_through_megatrons_parser"
TESTED: tuple[Run, ...] = (
    *_runs("megatron-lm", "dense", "emulated",
           ("one", PRETRAIN + "test_runs.py::test_snip_replans_saves_its_state_after_each_checkpoint_and_resumes_the_loaded_one"),
           ("pp", PRETRAIN + "test_runs.py::test_megatrons_model_data_and_pipeline_flags_keep_their_effect")),
    *_runs("megatron-lm", "dense", "te_hopper",
           ("one", PRETRAIN + "test_te_runs.py::test_hopper_one_process_measures_replans_saves_and_resumes")),
    *_runs("megatron-lm", "dense", "te_blackwell",
           ("one", PRETRAIN + "test_te_runs.py::test_a_linear_te_cannot_quantize_for_its_shape_is_kept_in_bf16_from_the_start")),
    *_runs("megatron-lm", "mla+mtp", "emulated",
           ("one", PRETRAIN + "test_mla_runs.py::test_one_process_measures_replans_and_resumes_the_checkpoint_plan"),
           ("pp", PRETRAIN + "test_mla_runs.py::test_pp2_with_mtp_measures_replans_per_stage_and_resumes")),
    *_runs("megatron-lm", "mla", "te_blackwell",
           ("tp", PRETRAIN + "test_mla_runs.py::test_tp2_sp_over_the_te_double_measures_replans_and_resumes")),
    *_runs("megatron-lm", "moe_local", "emulated",
           ("one", PRETRAIN + "test_moe_runs.py::test_one_process_moe_measures_replans_and_resumes_the_checkpoint_plan"),
           ("recompute", PRETRAIN + "test_moe_runs.py::test_moe_with_full_activation_recompute_measures_and_replans"),
           ("ep", PRETRAIN + "test_moe_runs.py::test_parallel_moe_measures_replans_and_resumes_the_checkpoint_plan[ep2]"),
           ("pp", PRETRAIN + "test_moe_runs.py::test_parallel_moe_measures_replans_and_resumes_the_checkpoint_plan[pp2]"),
           ("ep", PRETRAIN + "test_moe_runs.py::test_parallel_moe_measures_replans_and_resumes_the_checkpoint_plan[ep2_a2a]"),
           ("etp", PRETRAIN + "test_moe_runs.py::test_parallel_moe_measures_replans_and_resumes_the_checkpoint_plan[etp2]")),
    *_runs("megatron-lm", "moe_te_grouped", "te_hopper",
           ("one", PRETRAIN + "test_moe_runs.py::test_te_grouped_moe_trains_measures_replans_and_resumes_over_the_te_double")),
    *_runs("megatron-lm", "hybrid", "te_hopper",
           ("one", PRETRAIN + "test_hybrid_runs.py::test_one_process_hybrid_measures_replans_saves_and_resumes_and_mamba_is_refused_on_cpu"),
           ("pp", PRETRAIN + "test_hybrid_runs.py::test_patched_pretrain_hybrid_at_pp2_plans_each_segment_by_its_hybrid_layers_and_resumes")),
    *_runs("megatron-lm", "hybrid_moe", "te_hopper",
           ("one", PRETRAIN + "test_hybrid_runs.py::test_one_process_hybrid_moe_layer_with_grouped_experts_measures_replans_and_resumes")),
    *_runs("megatron-lm", "dense+mtp", "emulated",
           ("tp+pp+vpp", LAYOUT + "test_emulated_model_and_pipeline_parallelism_measure_replan_and_resume[dense_mtp]"),
           ("dp+recompute", LAYOUT + "test_emulated_data_parallel_with_the_distributed_optimizer_and_recompute"
                                     "[dense_mtp]")),
    *_runs("megatron-lm", "mla+mtp", "emulated",
           ("pp+vpp", LAYOUT + "test_emulated_model_and_pipeline_parallelism_measure_replan_and_resume[mla_mtp]"),
           ("dp+recompute", LAYOUT + "test_emulated_data_parallel_with_the_distributed_optimizer_and_recompute[mla_mtp]")),
    *(run for model, models in (("dense", "dense"), ("mla_mtp", "mla+mtp"), ("hybrid", "hybrid"))
      for backend, sm in GENERATIONS
      for run in _runs("megatron-lm", models, backend,
                       ("one", LAYOUT + f"test_te_chain_across_layouts_and_generations[{model}]"),
                       ("tp+pp+vpp", LAYOUT + f"test_te_chain_across_layouts_and_generations[{model}]"),
                       ("dp+recompute", LAYOUT + "test_te_data_parallel_with_the_distributed_optimizer_and_recompute"
                                                 f"[{model}-{sm}]"))),
    *(run for model, models in (("dense", "dense"), ("mla_mtp", "mla+mtp"), ("hybrid", "hybrid+hybrid_moe"),
                                ("moe", "moe_te_grouped"))
      for backend, _ in GENERATIONS for run in _runs(
        "megatron-lm", models, backend,
        ("cp", PRETRAIN + f"test_cp_runs.py::test_cp2_measures_replans_on_hopper_and_resumes_on_blackwell[{model}]"))),
    *(run for model, models in (("deepseek", "mla+mtp+moe_te_grouped"), ("hybrid", "hybrid_moe"))
      for backend, sm in GENERATIONS
      for run in _runs("megatron-lm", models, backend,
                       ("one", MOE_LAYOUT + f"test_te_grouped_experts_chain_across_layouts_and_generations[{model}]"),
                       ("tp+ep", MOE_LAYOUT + f"test_te_grouped_experts_chain_across_layouts_and_generations[{model}]"),
                       ("pp+vpp", MOE_LAYOUT + f"test_te_grouped_experts_chain_across_layouts_and_generations[{model}]"),
                       ("dp+ep+recompute", MOE_LAYOUT + "test_te_grouped_experts_with_the_distributed_optimizer_and_"
                                                        f"recompute[{model}-{sm}]"))),
    *(run for model, models in (("gpt", "moe_te_grouped"), ("hybrid", "hybrid_moe")) for backend, _ in GENERATIONS
      for run in _runs("megatron-lm", models, backend, ("tp+ep+etp", PRETRAIN + "test_moe_runs.py::test_te_grouped_"
                                                         f"experts_at_tp2_sp_etp2_ep2_alltoall_train_on_hopper_and_resume_on_blackwell[{model}]"))),
    *_runs("megatron-lm", "moe_local", "emulated",
           ("dp+ep+recompute", MOE_LAYOUT + "test_local_experts_with_the_distributed_optimizer_and_recompute")),
    *_runs("megatron-lm", "mla+mtp+moe_local", "emulated",
           ("pp+vpp", DEEPSEEK + "test_pipeline_with_virtual_stages_on_the_local_spec_measures_replans_and_resumes")),
    # snip-analyze on the checkpoints of the layout chains, at each link's layout (VPP dropped)
    *(run for model, models in (("dense", "dense"), ("mla_mtp", "mla+mtp"), ("hybrid", "hybrid"))
      for backend, _ in GENERATIONS for run in _runs(
        "analyze", models, backend, ("one", LAYOUT + f"test_te_chain_across_layouts_and_generations[{model}]"),
        ("tp+pp", LAYOUT + f"test_te_chain_across_layouts_and_generations[{model}]"))),
    *(run for model, models in (("deepseek", "mla+mtp+moe_te_grouped"), ("hybrid", "hybrid_moe"))
      for backend, _ in GENERATIONS for run in _runs(
        "analyze", models, backend,
        ("tp+ep+pp", MOE_LAYOUT + f"test_te_grouped_experts_chain_across_layouts_and_generations[{model}]"))),
    *(run for model in ("deepseek", "hybrid") for run in _runs(
        "analyze", "moe_te_grouped" if model == "deepseek" else "hybrid_moe", "te_blackwell",
        ("one", MOE_LAYOUT + f"test_te_grouped_experts_chain_across_layouts_and_generations[{model}]"))),
    *_runs("analyze", "dense+mtp", "emulated",
           ("tp+pp", LAYOUT + "test_emulated_model_and_pipeline_parallelism_measure_replan_and_resume[dense_mtp]")),
    *_runs("analyze", "mla+mtp", "emulated",
           ("pp", LAYOUT + "test_emulated_model_and_pipeline_parallelism_measure_replan_and_resume[mla_mtp]")),
    *_runs("analyze", "mla+mtp+moe_local", "emulated",
           ("pp", DEEPSEEK + "test_pipeline_with_virtual_stages_on_the_local_spec_measures_replans_and_resumes")),
    *_runs("analyze", "moe_local", "emulated",
           ("one", "tests/analyze/test_models.py::test_moe_checkpoints_local_and_te_grouped_are_analyzed_by_their_inventory")),
    *_runs("analyze", "moe_te_grouped", "te_hopper",
           ("one", "tests/analyze/test_models.py::test_moe_checkpoints_local_and_te_grouped_are_analyzed_by_their_inventory")),
    *_runs("analyze", "mla+mtp", "emulated",
           ("one", "tests/analyze/test_models.py::test_an_mla_checkpoint_with_an_mtp_layer_is_analyzed_by_its_inventory")),
    *_runs("analyze", "hybrid+hybrid_moe", "te_hopper",
           ("one", "tests/analyze/test_models.py::test_a_hybrid_checkpoint_is_analyzed_by_its_layer_pattern")),
    *_runs("bridge", "dense", "emulated",
           ("one", "tests/bridge/test_checkpoint.py::test_killed_and_resumed_run_matches_an_uninterrupted_one"),
           ("tp", "tests/bridge/test_distributed.py::test_layout_gives_the_single_process_plan[tp2]"),
           ("pp+vpp", "tests/bridge/test_distributed.py::test_layout_gives_the_single_process_plan[pp2_vpp2]"),
           ("dp", "tests/bridge/test_distributed.py::test_distributed_optimizer_resumes_exactly"),
           ("recompute", "tests/bridge/test_distributed.py::test_full_activation_recompute_gives_the_single_process_plan")),
    *_runs("bridge", "mla+mtp", "emulated",
           ("one", "tests/bridge/test_enable.py::test_multi_latent_attention_and_multi_token_prediction_replan_through_bridge")),
    *_runs("bridge", "moe_local", "emulated",
           ("one", "tests/bridge/test_enable.py::test_a_tiny_qwen3_moe_measures_and_replans_through_bridge"),
           ("ep+pp+dp+etp+vpp", BRIDGE_LAYOUT + "test_emulated_qwen3_moe_at_ep2_resumed_at_pp2_and_etp2_and_at_dp2_"
                                                "and_pp2_vpp2")),
    *(run for backend, _ in GENERATIONS for run in _runs(
        "bridge", "moe_te_grouped+hybrid_moe", backend,
        ("one", BRIDGE_LAYOUT + "test_te_chains_across_layouts_and_generations[moe]"),
        ("ep+pp", BRIDGE_LAYOUT + "test_te_chains_across_layouts_and_generations[moe]"))),
    *(run for backend, _ in GENERATIONS for run in _runs(
        "bridge", "moe_te_grouped+hybrid_moe", backend,
        ("cp+recompute", BRIDGE_LAYOUT + "test_te_chains_across_layouts_and_generations[moe_wide]"),
        ("tp+ep+etp+dp", BRIDGE_LAYOUT + "test_te_chains_across_layouts_and_generations[moe_wide]"))),
    *(run for backend, _ in GENERATIONS for run in _runs(
        "bridge", "moe_te_grouped", backend,
        ("vpp", BRIDGE_LAYOUT + "test_te_chains_across_layouts_and_generations[moe_wide]"))),
    *_runs("bridge", "hybrid", "te_hopper",
           ("one", "tests/bridge/test_enable.py::test_a_hybrid_model_replans_through_hybrid_model_provider_over_the_te_double")),
    *_runs("bridge", "moe_local", "emulated",
           ("recompute", "tests/bridge/test_enable.py::test_a_tiny_qwen3_moe_under_full_recompute_measures_and_replans")),
    *_runs("bridge", "mla+mtp+moe_local", "emulated",
           ("ep+pp", BRIDGE_LAYOUT + "test_emulated_deepseek_style_at_ep2_resumed_at_pp2")),
    *_runs("bridge", "mla+mtp", "emulated", ("pp+vpp", BRIDGE_LAYOUT + "test_emulated_mla_and_mtp_layouts")),
    *_runs("bridge", "mla+mtp", "emulated", ("dp+recompute", BRIDGE_LAYOUT + "test_emulated_mla_and_mtp_layouts")),
    *_runs("bridge", "dense+mtp", "emulated", ("tp", BRIDGE_LAYOUT + "test_emulated_mla_and_mtp_layouts")),
    *(run for backend, _ in GENERATIONS for run in (
        *_runs("bridge", "dense", backend,
               ("one", BRIDGE_CHAIN + "[dense]"), ("tp+pp+vpp+recompute", BRIDGE_CHAIN + "[dense]"),
               ("dp+cp", BRIDGE_CHAIN + "[dense]")),
        *_runs("bridge", "hybrid", backend,
               ("one", BRIDGE_CHAIN + "[hybrid]"), ("tp+pp+recompute", BRIDGE_CHAIN + "[hybrid]"),
               ("dp+cp", BRIDGE_CHAIN + "[hybrid]")),
        *_runs("bridge", "mla+mtp", backend,
               ("one", BRIDGE_CHAIN + "[mla_mtp]"), ("cp", BRIDGE_CHAIN + "[mla_mtp]"),
               ("tp+dp+recompute", BRIDGE_CHAIN + "[mla_mtp]")),
        *_runs("bridge", "mla+mtp", backend, ("pp+vpp", BRIDGE_CHAIN + "[mla_mtp]")),
        *_runs("bridge", "mla+mtp+moe_te_grouped", backend, ("ep+pp", BRIDGE_CHAIN + "[deepseek]")))),
    *_runs("bridge", "moe_local", "emulated", ("ep+pp", BRIDGE_CLI_MOE)),
    *_runs("bridge", "mla+mtp+moe_te_grouped", "te_hopper", ("ep", BRIDGE_CLI_MOE)),
    *_runs("bridge", "mla+mtp+moe_te_grouped", "te_blackwell", ("pp", BRIDGE_CLI_MOE)),
    *_runs("compact", "dense", "emulated",
           ("one", "tests/train/test_main_snip.py::test_compact_loop_with_snip_replans_and_logs"),
           ("dp", "tests/train/test_resume_distributed.py::test_resume_matches_uninterrupted_run_with_tp2_and_dp2"),
           ("tp", "tests/test_controller_distributed.py::test_tp_ranks_apply_the_single_process_plan"),
           ("pp", "tests/test_controller_distributed.py::test_pipeline_ranks_apply_the_single_process_plan")),
    *_runs("compact", "mla", "emulated",
           ("one", "tests/train/test_loop.py::test_multi_latent_attention_measures_replans_and_resumes"),
           ("pp", "tests/train/test_resume_distributed.py::test_resume_matches_uninterrupted_run_with_tp2_and_dp2"),
           ("dp", "tests/train/test_resume_distributed.py::test_resume_matches_uninterrupted_run_with_tp2_and_dp2")),
    *_runs("compact", "moe_local", "emulated",
           ("one", "tests/train/test_loop.py::test_moe_measures_replans_and_resumes")),
    *_runs("analyze", "dense", "emulated",
           ("one", "tests/analyze/test_compact.py::test_a_compact_loop_checkpoint_is_analyzed_without_writing_into_it"),
           ("tp", "tests/analyze/test_runs.py::test_a_tp2_megatron_lm_checkpoint_is_analyzed_without_writing_into_it"),
           ("pp", "tests/analyze/test_runs.py::test_a_tp2_megatron_lm_checkpoint_is_analyzed_without_writing_into_it")),
    *(Run("export", (model,), backend, (layout,), EXPORT_CELL + f"[{model}-{backend}-{layout}]")
      for model in MODELS for backend in BACKENDS for layout in ("one", "pp", "vpp")
      if backend != "emulated" or model in ("dense", "mla", "mtp", "moe_local")),
)

COMPACT_FLAGS = "the compact loop's flags are --tp, --pp, its processes and --distributed-optimizer"
EXPORT_PATHS = "a plan's recipe keys modules by their paths, which only the pipeline layout changes"
UNREACHABLE = {
    # (entry, "model" | "backend" | "layout", name) -> why
    **{("compact", "model", m): "the compact loop trains its presets (llama_tiny, llama_tiny_mla, llama_tiny_moe)"
       for m in ("mtp", "moe_te_grouped", "hybrid", "hybrid_moe", "hybrid_ssm")},
    **{("compact", "layout", layout): COMPACT_FLAGS for layout in ("vpp", "ep", "etp", "cp", "recompute")},
    **{("export", "layout", layout): EXPORT_PATHS for layout in ("tp", "dp", "ep", "etp", "cp", "recompute")},
    ("export", "model", "moe_te_grouped", "emulated"): "TE's grouped experts have no emulated linears; a plan's "
                                                       "emulated export is the SequentialMLP's (moe_local)",
}
EXPERT_LAYOUTS = ("ep", "etp")
"""Layout classes only a model with experts has."""
