"""snip-analyze on a checkpoint of every model shape SNIP trains in Megatron-LM's loop, one process
each: an MoE GPT (`--num-experts 4 --moe-router-topk 2`, layer 1 MoE) on the local spec
(SequentialMLP experts) and on TE's grouped experts over the TE double (standing in for an H100),
a multi-latent-attention GPT with a multi-token-prediction layer, and a HybridModel (`*-*E`:
attention, MLP and an MoE layer of TE grouped and shared experts, over the TE double). Each plan
is keyed by the model's inventory (built here without training) and each static recipe, read by
Megatron's parser and Bridge's instantiation, gives every planned module of the model the
analysis built its precision; the checkpoint is left as it was. The runs give no --train-iters
(an analysis needs none), and their output is snip-analyze's alone (SNIP's lines and the table,
not Megatron's argument table, logs or warnings), unless `-v`. A hybrid checkpoint analyzed
without its --hybrid-layer-pattern is refused in one line naming it."""

from pathlib import Path

import pytest

from snip_megatron.megatron.smoke import SMOKE_SHAPE
from snip_megatron.models import gpt, hybrid
from snip_megatron.plan import Plan
from tests.analyze.helpers import analyze, at_once, check_analysis, snapshot
from tests.pretrain import test_mla_runs
from tests.pretrain.test_moe_runs import MOE
from tests.pretrain.test_runs import MODEL, needs_training, run
from tests.pretrain.test_te_runs import TE, WORKER, run_te, te_env

pytestmark = pytest.mark.launches

DATA = ["--mock-data", "--vocab-size", "256", "--eval-interval", "100"]
SAVE = ["--train-iters", "2", "--save-interval", "2"]
EXPERTS = gpt.MoEDims(num_experts=4, topk=2, ffn_hidden_size=32, layer_freq=(1, 0))
SHAPE = SMOKE_SHAPE.with_(num_layers=2)


def budgets(*values: float) -> list:
    return ["--budgets", ",".join(map(str, values)), "--analyze-microbatches", "2"]


def analyzed(tmp_path, ckpt: Path, *argv: str, env=None) -> tuple:
    """snip-analyze of `ckpt` with the run's flags `argv` (its own first); (stdout, the module paths
    of the model it built {path: key}); the checkpoint checked unchanged."""
    import json

    before = snapshot(ckpt)
    proc = analyze(tmp_path, tmp_path / "record", *argv, "--load", str(ckpt), "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert snapshot(ckpt) == before
    return proc.stdout, json.loads((tmp_path / "record" / "modules.json").read_text())


def check_quiet(printed: str) -> None:
    """Only SNIP's lines and the table: none of Megatron's argument table, logs, timings."""
    lines = printed.splitlines()
    assert all(line.startswith("[snip") or line[:8].strip().replace(".", "").isdigit() or
               line.lstrip().startswith("budget") for line in lines), lines
    assert len(lines) < 20, lines


@needs_training
def test_moe_checkpoints_local_and_te_grouped_are_analyzed_by_their_inventory(tmp_path):
    """The issue's run: Megatron-LM's loop with --num-experts 4 --moe-router-topk 2, trained plainly,
    analyzed without --train-iters: expert units planned (each local expert of the SequentialMLP
    matched), BF16 router; then TE's grouped experts over the TE double at SM90 (FP8 budgets)."""
    keys = [str(k) for k in gpt.inventory(SHAPE, moe=EXPERTS).keys()]
    local, grouped = tmp_path / "local", tmp_path / "grouped"
    local.mkdir(), grouped.mkdir()
    te_flags = [*MOE, "--moe-grouped-gemm", *DATA]
    at_once(lambda: run(local, ["-m", "snip_megatron.pretrain"], *MOE, *DATA, *SAVE, "--save", str(local / "ckpt")),
            lambda: run_te(grouped, [str(WORKER), str(grouped / "probe")], *te_flags, *SAVE, "--save",
                           str(grouped / "ckpt"), sm=90))
    (printed, modules), (te_printed, te_modules) = at_once(
        lambda: analyzed(local, local / "ckpt", *MODEL, *MOE, *DATA, *budgets(0.5, 0.75)),
        lambda: analyzed(grouped, grouped / "ckpt", *MODEL, *TE, *te_flags, *budgets(0.5, 0.75), env=te_env(90)))
    check_quiet(printed)
    assert f"[snip-analyze] {local / 'ckpt'} at step 2: 2 micro-batches measured" in printed
    assert sorted(modules.values()) == sorted(keys + ["1.expert_fc1"] * 3 + ["1.expert_fc2"] * 3)  # 4 experts
    doc = check_analysis(local / "out", printed, [0.5, 0.75], linears=8, step=2, modules=modules)
    assert [str(k) for k in Plan.load(local / "out" / doc["plans"][0]["files"]["json"])] == keys

    check_quiet(te_printed)
    assert sorted(te_modules.values()) == sorted(keys) and "decoder.layers.0.mlp.experts.linear_fc1" in te_modules
    check_analysis(grouped / "out", te_printed, [0.5, 0.75], linears=8, step=2, kind="fp8_fraction",
                   modules=te_modules)


@needs_training
def test_an_mla_checkpoint_with_an_mtp_layer_is_analyzed_by_its_inventory(tmp_path):
    """Multi-latent attention (q/kv down- and up-projections) and one MTP layer, trained with SNIP;
    the MTP linears are never FP4 (as Megatron), so 0.6 is near the largest FP4 budget. With -v,
    Megatron's own output is shown as well."""
    flags = [*test_mla_runs.MLA, *test_mla_runs.Q_LORA, "--mtp-num-layers", "1", *DATA]
    test_mla_runs.train(tmp_path, *flags, *test_mla_runs.SNIP[5:], *SAVE, "--save", str(tmp_path / "ckpt"))
    printed, modules = analyzed(tmp_path, tmp_path / "ckpt", *test_mla_runs.MODEL, *flags, *budgets(0.5, 0.6), "-v")
    assert "------------------------ arguments ------------------------" in printed  # -v: Megatron's table
    inventory = gpt.inventory(SHAPE.with_(num_query_groups=4), mla=mla_dims(), mtp_num_layers=1)
    assert sorted(modules.values()) == sorted(str(k) for k in inventory.keys())  # 22: 7 per layer, 8 MTP
    doc = check_analysis(tmp_path / "out", printed, [0.5, 0.6], linears=22, step=2, modules=modules)
    for p in doc["plans"]:
        plan = Plan.load(tmp_path / "out" / p["files"]["json"]).check_model(inventory)
        assert {v.value for k, v in plan.items() if gpt.is_mtp(k)} <= {"bf16", "fp8"}


def mla_dims() -> gpt.MLADims:
    """test_mla_runs.MLA and Q_LORA's widths."""
    flags = dict(zip(test_mla_runs.MLA[1::2], test_mla_runs.MLA[2::2]))
    return gpt.MLADims(q_lora_rank=int(test_mla_runs.Q_LORA[1]), kv_lora_rank=int(flags["--kv-lora-rank"]),
                       qk_head_dim=int(flags["--qk-head-dim"]), qk_pos_emb_head_dim=int(flags["--qk-pos-emb-head-dim"]),
                       v_head_dim=int(flags["--v-head-dim"]))


@needs_training
def test_a_hybrid_checkpoint_is_analyzed_by_its_layer_pattern(tmp_path):
    """`*-*E` over the TE double (Megatron's hybrid spec is TE-only): attention layers 1 and 3, MLP
    layer 2, MoE layer 4 (grouped and shared experts); keyed by hybrid layer, its recipes' module
    paths the pattern's. Without --hybrid-layer-pattern the checkpoint is another model, said in one line."""
    pytest.importorskip("megatron.core.models.hybrid.hybrid_model", reason="HybridModel: megatron-core >= 0.18")
    pattern = "*-*E"
    flags = ["--hybrid-layer-pattern", pattern, *MOE[:6], "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size",
             "32", *DATA]
    run_te(tmp_path, [str(WORKER), str(tmp_path / "probe")], *flags, *SAVE, "--save", str(tmp_path / "ckpt"), sm=90,
           PROBE_FAMILY="hybrid")
    (printed, modules), other = at_once(
        lambda: analyzed(tmp_path, tmp_path / "ckpt", *MODEL, *TE, *flags, *budgets(0.5, 0.75), env=te_env(90)),
        lambda: analyze(tmp_path, tmp_path / "refused", *MODEL, *TE, *flags[2:], "--load", str(tmp_path / "ckpt"),
                        "--out", str(tmp_path / "other"), env=te_env(90)))
    check_quiet(printed)
    moe = gpt.MoEDims(num_experts=4, topk=2, ffn_hidden_size=32, shared_ffn_hidden_size=32)
    inventory = hybrid.inventory(SHAPE.with_(num_layers=4), pattern, moe=moe)
    assert sorted(modules.values()) == sorted(str(k) for k in inventory.keys())  # 10 linears
    assert modules["decoder.layers.3.mlp.experts.linear_fc1"] == "4.expert_fc1"
    check_analysis(tmp_path / "out", printed, [0.5, 0.75], linears=10, step=2, kind="fp8_fraction", modules=modules)

    last = other.stderr.strip().splitlines()[-1]
    assert other.returncode == 2 and last.startswith(f"snip-analyze: error: --load {tmp_path / 'ckpt'}: the checkpoint "
                                                     "holds another model ("), other.stderr[-3000:]
    assert f"--hybrid-layer-pattern {pattern!r} there, None here" in last and not (tmp_path / "other").exists()
