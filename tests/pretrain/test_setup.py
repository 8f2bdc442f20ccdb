"""setup_megatron_lm's start-up checks (prod lane: megatron.training ships with megatron-core
>= 0.19; the compat lane checks the clear refusal in test_runs.py): the runs SNIP serves pass (each
rule's refusal is tested in tests/support), what this GPU and TE cannot run is refused with the
flag and fix, a user's precision config is merged or refused, the Megatron functions SNIP wraps are
checked against the parameters it was written for."""

import argparse

import pytest

pytest.importorskip("megatron.training.arguments",
                    reason="megatron.training ships only with megatron-core >= 0.19 (prod lane)")

from snip_megatron.pretrain import seams  # noqa: E402
from snip_megatron.pretrain.setup import check_run, resolve_backend, setup_megatron_lm  # noqa: E402
from tests.support.entry_inputs import megatron_lm_args  # noqa: E402


def megatron_args(*argv, world_size: int = 1):
    return megatron_lm_args(*argv, world_size=world_size)


def test_a_model_that_is_not_the_one_planned_is_refused_before_the_first_step(megatron_single):
    """The Megatron-LM entry's start-up agreement: every rank's built chunks against the inventory
    of the run's config (one all-gather), one line when they differ."""
    from types import SimpleNamespace

    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.megatron.smoke import SMOKE_SHAPE as shape
    from snip_megatron.models import gpt
    from snip_megatron.pretrain.setup import SnipRun

    model = build_gpt_model(shape, backend="emulated")
    SnipRun(config=None, controller=SimpleNamespace(), inventory=gpt.inventory(shape)).check_inventory([model])
    run = SnipRun(config=None, controller=SimpleNamespace(), inventory=gpt.inventory(shape, sequence_parallel=True))
    with pytest.raises(SystemExit, match=r"^SNIP: gpt inventory does not match the model built on these ranks "
                                         r"\(the config and the built layer spec disagree\): 1.linear_qkv differs"):
        run.check_inventory([model])


def test_moe_mla_and_mtp_on_the_layouts_snip_measures_are_planned_not_refused():
    for argv, world in (
            (["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[1,0]",
              "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias",
              "--moe-router-score-function", "sigmoid"], 1),
            (["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"], 2),
            (["--num-experts", "4", "--moe-router-topk", "2", "--pipeline-model-parallel-size", "2"], 2),
            (["--multi-latent-attention"], 1), (["--multi-latent-attention", "--q-lora-rank", "32"], 1),
            (["--multi-latent-attention", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
            (["--mtp-num-layers", "1"], 1), (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"], 2)):
        assert check_run(megatron_args("--snip", *argv, world_size=world)).config.enabled, argv


@pytest.fixture
def te_gpu(monkeypatch):
    """Transformer Engine "installed" on a GPU of a given generation (its capability patched where
    SNIP reads it), TE's environment switches unset."""
    import torch

    from snip_megatron.te import gpu, installed

    monkeypatch.setattr(installed, "te_installed", lambda: True)
    ok = installed.Availability(True)
    monkeypatch.setattr(installed, "read_te_support", lambda: installed.TESupport(
        version="2.14.0", fp8=ok, fp8_block_scaling=ok, mxfp8=ok, nvfp4=ok))
    for name in ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
                 "NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
                 "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"):
        monkeypatch.delenv(name, raising=False)

    def on(sm: int):
        monkeypatch.setattr(gpu, "current_sm", lambda: sm)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: divmod(sm, 10))  # Megatron asks

    return on


@pytest.mark.parametrize("argv, sm, env, words", [
    (["--snip-fp4-recipe", "mxfp4"], 100, {}, r"--snip-fp4-recipe='mxfp4': fp4_recipe='mxfp4' has no Transformer "
                                              r"Engine recipe .*FP4 runs on SNIP's emulated linears"),
    (["--snip-fp4-recipe", "mxfp4"], 90, {}, r"--snip-fp4-recipe='mxfp4'"),
    (["--snip-fp4-budget", "0.75"], 90, {}, r"--snip-fp4-recipe='nvfp4': TE's NVFP4 kernels need SM100\+ "
                                            r".Blackwell., this GPU is SM90 .Hopper.; before SM100 SNIP's TE backend "
                                            r"plans BF16 and FP8 .* drop fp4 from --snip-precisions and every FP4 "
                                            r"setting .--snip-fp4-budget"),
    (["--snip-precisions", "fp8,fp4"], 90, {}, r"NVFP4 kernels need SM100"),
    (["--snip-fp8-recipe", "mxfp8"], 90, {}, r"--snip-fp8-recipe='mxfp8': TE's MXFP8 needs SM100"),
    (["--snip-fp4-gradient-rounding", "stochastic"], 90, {}, "NVFP4 kernels need SM100"),
    (["--snip-fp8-block-scales", "fp32"], 90, {}, "set NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 where TE is imported"),
    ([], 100, {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}, "need power-of-two scales; unset"),
    ([], 100, {"NVTE_NVFP4_DISABLE_RHT": "1"}, "NVTE_NVFP4_DISABLE_RHT=1 turns off"),
    (["--snip-budget", "speedup", "--snip-speedup", "2.5"], 90, {}, r"--snip-speedup=2.5 cannot be reached"),
    (["--snip-fp8-budget", "0.8", "--snip-fp4-budget", "0.5"], 100, {}, "set --snip-budget to fp4_fraction"),
    ([], 80, {}, "has no FP8 tensor cores"),
])
def test_what_the_gpu_cannot_run_is_refused_with_the_flag_and_fix(te_gpu, monkeypatch, argv, sm, env, words):
    te_gpu(sm)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises((ValueError, argparse.ArgumentError), match=words):  # some refused as they parse
        check_run(megatron_args("--transformer-impl", "transformer_engine", "--snip", *argv))


def test_te_grouped_experts_are_taken_and_fp4_on_sizes_te_runs_unfused_is_said(te_gpu):
    """TE grouped experts run with SNIP (split padding, grouped_padding.py). TE's fused NVFP4 split
    quantize wants the hidden and expert FFN sizes in multiples of 128; on other sizes TE 2.14-2.18
    quantizes each expert's split on its unfused path, as a dense linear (csrc/extensions/cast.cpp):
    what SNIP measures, so a Blackwell run that may plan FP4 there starts, with a start-up line."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from snip_megatron.models import gpt
    from snip_megatron.te.shapes import unfused_grouped_nvfp4

    moe = ["--num-experts", "4", "--moe-grouped-gemm", "--hidden-size", "64", "--moe-ffn-hidden-size", "32"]
    te_gpu(90)
    hopper = check_run(megatron_args("--transformer-impl", "transformer_engine", "--snip", *moe))
    assert hopper.sm == 90
    te_gpu(100)
    args = megatron_args("--transformer-impl", "transformer_engine", "--snip", *moe)
    blackwell = check_run(args)
    assert blackwell.sm == 100 and "fp4" in blackwell.config.uses_names
    inventory = gpt.of_config(core_transformer_config_from_args(args))
    assert unfused_grouped_nvfp4(inventory, blackwell.config.uses, blackwell.config.fp4_recipe) == (
        "MoE: the grouped experts' NVFP4 inputs and gradients of inner size 32, 64 (not multiples of 128) are "
        "quantized on TE's unfused path, one expert at a time as a dense linear's are (TE warns 'Unfused NVFP4 "
        "quantization fallback'): slower than the fused kernel, the same arithmetic SNIP measures")
    assert unfused_grouped_nvfp4(inventory, hopper.config.uses, hopper.config.fp4_recipe) is None  # no FP4
    wide = megatron_args("--transformer-impl", "transformer_engine", "--snip", *moe[:3],
                         "--hidden-size", "128", "--moe-ffn-hidden-size", "256")
    assert unfused_grouped_nvfp4(gpt.of_config(core_transformer_config_from_args(wide)), blackwell.config.uses,
                                 "nvfp4") is None


def test_what_each_generation_runs_by_default(te_gpu):
    from snip_megatron.formats.precision import Formats
    from snip_megatron.megatron.te_run import startup_lines

    args = megatron_args("--transformer-impl", "transformer_engine", "--snip")
    te_gpu(90)
    hopper = check_run(args)
    assert hopper.sm == 90 and hopper.config.formats == Formats(fp8_block_scales="pow2")
    assert (hopper.config.precisions, hopper.config.budget, hopper.config.fp8_budget) == \
        (["bf16", "fp8"], "fp8_fraction", 0.9)
    assert startup_lines(hopper.te)[:2] == [
        "[snip] SM90 (Hopper): FP8 blockwise (e4m3, pow2 scales) on TE kernels; plan budget >= 90% of linear "
        "FLOPs in FP8, from bf16,fp8 (GEMM cost bf16=1,fp8=0.5)", "[snip] Transformer Engine 2.14.0"]
    te_gpu(100)
    blackwell = check_run(args)
    assert blackwell.config.formats == Formats(fp8_block_scales="pow2", fp4_gradient_rounding="stochastic")
    assert (blackwell.config.precisions, blackwell.config.budget) == (["fp8", "fp4"], "fp4_fraction")
    # Hopper's speed question, the flags of earlier releases: BF16 vs FP8 under the modelled speed-up.
    te_gpu(90)
    fast = check_run(megatron_args("--transformer-impl", "transformer_engine", "--snip", "--snip-precisions",
                                   "bf16,fp8", "--snip-budget", "speedup", "--snip-speedup", "1.6"))
    assert fast.config.planner_config().budget == "speedup"
    line = startup_lines(fast.te)[0]
    assert "FP4" not in line and "modelled linear-GEMM speed-up >= 1.6x" in line
    # The emulated backend plans FP4 on any GPU, with the recipes' own variants (the CPU benchmarks' numerics).
    emulated = check_run(megatron_args("--snip")).config
    assert emulated.formats == Formats() and emulated.precisions == ["fp8", "fp4"]


def test_the_layouts_of_a_70b_run_are_accepted_while_snip_measures(te_gpu):
    te_gpu(90)  # CP needs Transformer Engine's attention
    args = megatron_args("--snip", "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
                         "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                         "--context-parallel-size", "2", "--use-distributed-optimizer", world_size=8)
    assert check_run(args).config.enabled


def test_a_plain_run_is_accepted_and_snip_off_does_nothing():
    args = megatron_args("--snip")
    assert check_run(args).config.enabled and resolve_backend(args) == "emulated"
    model_cfg = argparse.Namespace(transformer_layer_spec=None)
    assert setup_megatron_lm(megatron_args(), model_cfg) is None and model_cfg.transformer_layer_spec is None
    with pytest.raises(argparse.ArgumentError, match="bad SNIP flags: --snip-pin-plan is set but --snip-plan is empty"):
        megatron_args("--snip", "--snip-pin-plan")  # refused as Megatron's parser parses
    args = megatron_args("--snip")
    args.snip_pin_plan = True  # arguments that did not come through the parser (another entry point)
    with pytest.raises(SystemExit, match="SNIP: bad SNIP flags: --snip-pin-plan is set but --snip-plan is empty"):
        setup_megatron_lm(args, model_cfg)


def test_the_wrapped_megatron_functions_have_the_expected_parameters(monkeypatch):
    seams.check_seams()  # this Megatron: as written for
    from megatron.training import training

    monkeypatch.setattr(training, "train_step", lambda data_iterator, model: None)
    with pytest.raises(RuntimeError, match=r"megatron.training.training.train_step takes \(data_iterator, model"):
        seams.check_seams()


YAML = """
matchers:
  out:
    enabled: true
    type: glob
    pattern: "*output_layer*"
    config: keep_high
{extra}
configs:
  keep_high:
    transformer_engine_config_type: TEQuantizationParams
    training_recipe: {{}}
"""


def test_a_user_precision_config_is_merged_or_refused(tmp_path):
    from megatron.core.quantization.quant_config import MatchContext
    from megatron.core.quantization.utils import load_quantization_recipe

    from snip_megatron.formats.precision import Formats
    from snip_megatron.plan import Plan
    from snip_megatron.pretrain.model import check_user_recipe, merged_recipe

    ok = tmp_path / "ok.yaml"
    ok.write_text(YAML.format(extra=""))
    user = load_quantization_recipe(str(ok))  # Megatron's own parser of --te-precision-config-file
    check_user_recipe(user, 4, "--te-precision-config-file")
    config = argparse.Namespace(num_layers=4, pipeline_model_parallel_size=1)
    plan = Plan.uniform(4, "fp8").replace({"2.linear_fc1": "fp4"})
    recipe = merged_recipe(plan, _layout_config(), None, backend="emulated", formats=Formats(), user_recipe=user)
    assert recipe.match_to_config_key(MatchContext("decoder.layers.1.mlp.linear_fc1", 1)) == "fp4"
    assert recipe.match_to_config_key(MatchContext("output_layer", None)) == "keep_high"
    del config
    bad = tmp_path / "bad.yaml"
    bad.write_text(YAML.format(extra='  fc1:\n    enabled: true\n    type: glob\n    pattern: "*linear_fc1"\n'
                                     '    config: keep_high'))
    with pytest.raises(ValueError, match=r"sets decoder.layers.0.mlp.linear_fc1 \(config 'keep_high'\), a "
                                         r"linear SNIP plans"):
        check_user_recipe(load_quantization_recipe(str(bad)), 4, "--te-precision-config-file")

    # A HybridModel run (snip-pretrain-hybrid checks the same file against the pattern's inventory):
    # merged into a chunk's recipe at that chunk's hybrid offset, refused where it sets a planned
    # linear, named by the path Megatron gives it in that pattern (MLP layer 2, Mamba layer 1).
    from snip_megatron.models import hybrid
    from snip_megatron.models.keys import LayerKey
    from snip_megatron.shapes import ModelShape

    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)
    inv = hybrid.inventory(shape, "*-|*-")
    check_user_recipe(user, inv, "--te-precision-config-file")
    plan = Plan({k: "fp4" if k == LayerKey(4, "linear_fc1") else "fp8" for k in inv.keys()}, inventory=inv)
    recipe = merged_recipe(plan, _layout_config(), None, backend="emulated", formats=Formats(), user_recipe=user,
                           inventory=inv, offset=2)  # the second pipeline stage's chunk: layers 3, 4
    assert recipe.match_to_config_key(MatchContext("decoder.layers.1.mlp.linear_fc1", 1)) == "fp4"
    assert recipe.match_to_config_key(MatchContext("decoder.layers.0.self_attention.linear_qkv", 0)) == "fp8"
    assert recipe.match_to_config_key(MatchContext("output_layer", None)) == "keep_high"
    with pytest.raises(ValueError, match=r"sets decoder.layers.1.mlp.linear_fc1 \(config 'keep_high'\), a "
                                         r"linear SNIP plans"):
        check_user_recipe(load_quantization_recipe(str(bad)), inv, "--te-precision-config-file")
    mamba = tmp_path / "mamba.yaml"
    mamba.write_text(YAML.format(extra='  in:\n    enabled: true\n    type: glob\n    pattern: "*mixer.in_proj"\n'
                                       '    config: keep_high'))
    with pytest.raises(ValueError, match=r"sets decoder.layers.0.mixer.in_proj \(config 'keep_high'\)"):
        check_user_recipe(load_quantization_recipe(str(mamba)), hybrid.inventory(shape, "M*-*"),
                          "--te-precision-config-file")
    check_user_recipe(load_quantization_recipe(str(mamba)), inv, "--te-precision-config-file")  # no Mamba layer


def _layout_config():
    from snip_megatron.megatron.layout import layout_config
    from snip_megatron.shapes import ModelShape

    return layout_config(ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                    num_query_groups=2))


def test_a_saved_plan_with_fp4_is_refused_at_start_on_hopper_with_te(te_gpu):
    """--snip-plan with FP4 linears on SM90 with TE linears: refused before anything is built (TE has
    no FP4 SNIP plans there), with the reason; the same plan runs on SM100."""
    from types import SimpleNamespace

    from snip_megatron.plan import Plan
    from snip_megatron.pretrain.setup import SnipRun

    plan = Plan.uniform(2, "fp8").replace({"1.linear_fc1": "fp4"})
    for sm in (90, 100):
        te_gpu(sm)
        args = megatron_args("--transformer-impl", "transformer_engine", "--snip",
                             *(["--snip-fp4-budget", "0.1"] if sm == 100 else []))
        run = SnipRun(config=check_run(args).config, controller=SimpleNamespace(), backend="te", sm=sm)
        if sm == 90:
            with pytest.raises(ValueError, match=r"the plan puts linears in fp4, which the te backend cannot run "
                                                 r"here: FP4 nvfp4: TE's NVFP4 kernels need SM100\+"):
                run.check_plan_runs(plan)
        else:
            run.check_plan_runs(plan)


def test_snips_figures_go_to_megatrons_own_writers(monkeypatch):
    """run_loggers: Megatron's TensorBoard and W&B writers (global_vars), asked when SNIP writes."""
    from megatron.training import global_vars

    from snip_megatron.loggers import TensorBoardWriter, WandbWriter
    from snip_megatron.pretrain.setup import run_loggers
    from tests.test_loggers import FakeWandb, Recorder

    assert not run_loggers(megatron_args()).enabled  # no --tensorboard-dir, no --wandb-project
    loggers = run_loggers(megatron_args("--wandb-project", "p", "--wandb-exp-name", "e"))
    assert loggers.enabled and loggers.writers() == []  # Megatron has not made its writers yet (or not here)
    tb, wandb = Recorder(), FakeWandb()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", tb)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", wandb)
    tb_writer, wandb_writer = loggers.writers()
    assert isinstance(tb_writer, TensorBoardWriter) and tb_writer.writer is tb
    assert isinstance(wandb_writer, WandbWriter) and wandb_writer.run is wandb
