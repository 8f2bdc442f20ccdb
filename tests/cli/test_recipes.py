"""Hydra recipes: every file composes against the schema, layouts are checked field by field,
and the 70B recipe becomes exactly the Megatron-LM arguments a 64-rank run needs."""

from dataclasses import fields
from pathlib import Path

import pytest

from snip_megatron.cli.command import compact_args, megatron_args, training_target
from snip_megatron.cli.recipe import compose_recipe, default_config_dir
from snip_megatron.config import BASELINES
from snip_megatron.shapes import PRESETS
from snip_megatron.train.config import TrainingSchedule

CONFIGS = default_config_dir()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_config_dir_is_the_repository_configs():
    assert CONFIGS == Path(__file__).resolve().parents[2] / "configs"
    assert (CONFIGS / "config.yaml").is_file()


def test_groups_hold_the_promised_recipes():
    assert not (CONFIGS / "model").exists()  # the model presets exist once: snip_megatron.shapes
    assert {"off", "default", "aggressive", *BASELINES} <= set(options("snip"))
    assert {"single", "tp4_pp2", "tp8_pp8", "tp8_pp8_vpp2", "dp2"} <= set(options("parallel"))
    assert {"mock", "stdlib"} <= set(options("data"))
    assert {"tiny", "pretrain"} <= set(options("train"))


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_model_recipes_are_the_shape_presets(model):
    recipe = compose_recipe([f"model={model}"] + ([] if model == "llama_tiny" else ["parallel=single"]))
    assert recipe.model.shape() == PRESETS[model] and recipe.model.name == model


def test_a_preset_field_can_be_overridden_and_is_typed():
    recipe = compose_recipe(["model=llama_7b", "model.seq_length=4096", "train=pretrain"])
    assert recipe.model.shape() == PRESETS["llama_7b"].with_(seq_length=4096)
    with pytest.raises(ValueError, match="seq_length"):
        compose_recipe(["model.seq_length=long"])
    with pytest.raises(ValueError, match="no_such_field"):
        compose_recipe(["model.no_such_field=1"])


# A layout each recipe of a group composes with (the tiny model cannot take TP=8).
PAIR_MODEL = {"tp4_pp2": "llama_7b", "tp8_pp8": "llama_70b", "tp8_pp8_vpp2": "llama_70b",
              "tp2_pp2_dp2": "llama_1b", "tp1_dp8": "llama_1b"}


@pytest.mark.parametrize("parallel", options("parallel"))
def test_every_parallel_recipe_composes(parallel):
    model = PAIR_MODEL.get(parallel, "llama_tiny")
    train = "tiny" if model == "llama_tiny" else "pretrain"
    recipe = compose_recipe([f"parallel={parallel}", f"model={model}", f"train={train}"])
    par = recipe.parallel
    assert par.tp * par.pp * par.data_parallel_size == par.world_size


@pytest.mark.parametrize("group", ["snip", "data", "train"])
def test_every_recipe_of_the_other_groups_composes(group):
    for name in options(group):
        overrides = [f"{group}={name}"]
        if (group, name) == ("data", "indexed"):
            overrides += ["data.path=/data/tokens", "data.tokenizer=/data/tokenizer.json"]
        recipe = compose_recipe(overrides)
        assert getattr(recipe, group).name == name


def test_snip_recipes():
    assert not compose_recipe(["snip=off"]).snip.enabled
    default = compose_recipe([]).snip.snip_config()
    # The plan's precisions and budget follow the GPU (unset): the paper's where FP4 runs.
    assert default.enabled and default.measures and (default.precisions, default.fp4_budget) == (None, None)
    assert default.resolved().fp4_budget == 0.75 and default.resolved("te", sm=90).fp8_budget == 0.9
    aggressive = compose_recipe(["snip=aggressive"]).snip
    assert aggressive.fp4_budget == 0.9 and "bf16" in aggressive.precisions
    for name in BASELINES:
        cfg = compose_recipe([f"snip={name}"]).snip.snip_config()
        assert cfg.baseline == name and not cfg.measures


def test_overrides_reach_the_recipe():
    recipe = compose_recipe(["model=llama_7b", "parallel=tp4_pp2", "snip.fp4_budget=0.8", "train=pretrain"])
    assert recipe.model.num_layers == 32 and recipe.parallel.tp == 4 and recipe.parallel.pp == 2
    assert recipe.snip.fp4_budget == 0.8
    assert recipe.entry == "megatron" and compose_recipe([]).entry == "compact"
    assert recipe.train.run_dir == "runs/llama_7b-default"


@pytest.mark.parametrize("overrides, message", [
    (["parallel=tp8_pp8"], r"model\.num_attention_heads=4 is not divisible by parallel\.tp=8"),
    (["model=llama_1b", "parallel=tp8_pp8"], r"model\.num_query_groups=4 is not divisible by parallel\.tp=8"),
    (["model=llama_1b", "parallel=pp2", "parallel.pp=4", "parallel.nproc_per_node=4"],
     r"model\.num_layers=22 is not divisible by parallel\.pp=4"),
    (["model=llama_70b", "parallel=tp8_pp8_vpp2", "parallel.vpp=3"],
     r"model\.num_layers=80 is not divisible by parallel\.pp x parallel\.vpp = 8 x 3"),
    (["model=llama_70b", "parallel=tp8_pp8", "parallel.nnodes=4"],
     r"parallel\.tp x parallel\.pp x parallel\.dp = 8 x 8 x 1 = 64 != world size 32"),
    (["parallel=dp2", "parallel.nproc_per_node=3", "parallel.tp=2"], r"world size 3 .* not divisible"),
    (["parallel.vpp=2"], r"parallel\.vpp=2 needs parallel\.pp > 1"),
    (["parallel.sequence_parallel=true"], r"parallel\.sequence_parallel needs parallel\.tp > 1"),
    (["parallel.recompute=some"], r"parallel\.recompute='some' is not valid"),
    (["train.transformer_impl=te"], r"train\.transformer_impl='te' is not valid"),
    (["parallel=dp2", "train.global_batch_size=6"], r"train\.global_batch_size=6 is not divisible"),
    (["model.num_query_groups=3"], r"model\.num_attention_heads=4 is not divisible by num_query_groups=3"),
    (["snip.fp4_budget=1.5"], r"snip\.fp4_budget must be a fraction in \[0, 1\]"),
    (["snip.precisions=[fp8,int4]"], r"snip\.precisions has unknown precision 'int4'"),
    (["snip.lag=2000"], r"snip\.lag=2000 must be smaller than snip\.interval=1000"),
    (["snip.baseline=best"], r"snip\.baseline='best' is not valid"),
    (["train.entry=slurm"], r"train\.entry='slurm' is not valid"),
    (["data=indexed"], r"data\.kind=indexed needs data\.path"),
    (["model.num_layers=many"], r"cannot compose recipe .*model\.num_layers"),
    (["model.depth=3"], r"cannot compose recipe .*model\.depth"),
    (["model=llama_13b"], r"cannot compose recipe .*llama_13b"),
])
def test_bad_recipes_fail_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_recipe(overrides)


EXPECTED_70B = [
    "--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672",
    "--num-attention-heads", "64", "--group-query-attention", "--num-query-groups", "8",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
    "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--use-distributed-optimizer", "--transformer-impl", "transformer_engine",
    "--micro-batch-size", "1", "--global-batch-size", "1024", "--train-iters", "100000",
    "--lr", "0.0003", "--min-lr", "3e-05", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2000",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1",
    "--seed", "1234", "--bf16",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--mock-data",
    "--log-interval", "10", "--eval-interval", "1000", "--eval-iters", "20",
    "--save", "runs/llama_70b-default", "--load", "runs/llama_70b-default", "--save-interval", "1000",
    "--snip", "--snip-fp4-budget", "0.8",
]


def test_llama_70b_tp8_pp8_on_64_ranks_becomes_these_megatron_arguments():
    recipe = compose_recipe(["model=llama_70b", "parallel=tp8_pp8", "train=pretrain", "data=mock",
                             "snip.fp4_budget=0.8"])
    assert recipe.parallel.world_size == 64 and recipe.parallel.data_parallel_size == 1
    assert megatron_args(recipe) == EXPECTED_70B
    assert training_target(recipe) == ["-m", "snip_megatron.pretrain", *EXPECTED_70B]


def test_vpp_and_corpus_arguments():
    recipe = compose_recipe(["model=llama_70b", "parallel=tp8_pp8_vpp2", "data=stdlib"])
    args = megatron_args(recipe)
    assert args[args.index("--num-layers-per-virtual-pipeline-stage") + 1] == "5"  # 80 / (8 x 2)
    assert "--mock-data" not in args
    assert args[args.index("--corpus") + 1] == "stdlib"
    assert args[args.index("--split") + 1] == "95,5,0"


def test_megatron_accepts_the_generated_arguments():
    """Every generated flag exists in Megatron-LM's parser (plus snip-pretrain-gpt's own)."""
    pytest.importorskip("megatron.training.arguments",
                        reason="megatron.training ships only with megatron-core >= 0.19 (prod lane)")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from snip_megatron.pretrain.entry import add_extra_args

    parser = add_extra_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    for overrides in (["model=llama_70b", "parallel=tp8_pp8_vpp2", "train=pretrain", "snip=aggressive"],
                      ["model=llama_1b", "parallel=tp1_dp8", "train=pretrain", "data=stdlib",
                       "snip=first_last_k", "train.tensorboard_dir=tb", "train.wandb_project=snip"],
                      ["model=llama_tiny_mla", "train.entry=megatron"],
                      ["model=llama_tiny_moe", "train.entry=megatron"]):
        args = parser.parse_args(megatron_args(compose_recipe(overrides)))
        assert args.num_layers in (80, 22, 6)
        # the MLA preset's attention reaches Megatron-LM (never a dense model of its shape)
        assert args.multi_latent_attention == (args.num_layers == 6 and args.num_experts is None)
        if args.num_experts:  # the MoE preset's experts reach Megatron-LM, every other layer MoE
            assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 176)
            assert args.moe_layer_freq == 2 and not args.moe_grouped_gemm
        if args.multi_latent_attention:
            assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.v_head_dim) == (64, 64, 32, 32)
        from snip_megatron.megatron.args import snip_config_from_args

        assert snip_config_from_args(args).enabled


def test_tiny_recipe_becomes_compact_loop_arguments():
    recipe = compose_recipe(["train.steps=200", "snip.fp4_budget=0.8"])
    assert recipe.entry == "compact" and recipe.data.kind == "corpus"
    args = compact_args(recipe)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert value["--model"] == "llama_tiny" and value["--steps"] == "200"
    assert value["--corpus"] == "stdlib" and value["--vocab-size"] == "4096"
    assert "--precision" not in value  # SNIP's controller decides the initial plan
    assert args[args.index("--snip"):] == ["--snip", "--snip-fp4-budget", "0.8"]
    assert training_target(recipe)[:2] == ["-m", "snip_megatron.train"]


def test_compact_loop_parses_its_arguments():
    """The compact loop's parser takes every argument of the recipe, the --snip* flags included."""
    from snip_megatron.train.__main__ import parse_args

    args = compact_args(compose_recipe(["parallel=dp2", "train.steps=120", "snip.fp4_budget=0.8"]))
    config, snip, _ = parse_args(args)
    assert (config.steps, config.global_batch_size, config.distributed_optimizer) == (120, 8, True)
    assert snip.enabled and snip.fp4_budget == 0.8 and config.formats == snip.formats
    recipe = compose_recipe(["parallel=dp2", "train.steps=120"])
    for f in fields(TrainingSchedule):  # every schedule field reaches the compact loop unchanged
        assert getattr(config, f.name) == getattr(recipe.train, f.name), f.name


@pytest.mark.parametrize("overrides, message", [
    (["data=mock"], "train.entry=compact trains on real text"),
    (["model.num_layers=4"], "model.num_layers=4 differs from llama_tiny's 6"),
    (["model=llama_1b", "train.entry=compact", "model.name=mine"], "model.name='mine' is not one"),
    (["parallel=tp2", "parallel.sequence_parallel=true", "snip=off"],
     "no virtual pipeline, sequence parallelism, recompute or Transformer Engine spec"),
])
def test_compact_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        compact_args(compose_recipe(overrides))


def test_loggers_reach_both_loops():
    """train.tensorboard_dir becomes --tensorboard-dir of either loop; W&B is Megatron-LM's loop's."""
    tb = ["train.tensorboard_dir=${train.run_dir}/tensorboard"]
    recipe = compose_recipe(tb + ["model=llama_1b", "train.wandb_project=snip"])
    args = megatron_args(recipe)
    assert args[args.index("--tensorboard-dir") + 1] == "runs/llama_1b-default/tensorboard"
    assert args[args.index("--wandb-project"):args.index("--wandb-project") + 4] == [
        "--wandb-project", "snip", "--wandb-exp-name", "llama_1b-default"]
    args = compact_args(compose_recipe(tb))
    assert args[args.index("--tensorboard-dir") + 1] == "runs/llama_tiny-default/tensorboard"
    assert "--tensorboard-dir" not in compact_args(compose_recipe([]))
    with pytest.raises(ValueError, match="train.entry=compact writes TensorBoard only"):
        compact_args(compose_recipe(["train.wandb_project=snip"]))
