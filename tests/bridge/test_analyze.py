"""snip-analyze on Megatron-Bridge checkpoints of the tiny recipe's model shapes, each trained 2 steps
and saved: a tiny Qwen3-MoE (plain Bridge; every layer MoE, SequentialMLP experts) and an MLA model
with an MTP layer (Bridge's MLAModelProvider, trained with SNIP: Megatron's MTP spec needs SNIP's
linears without TE), both in this process, and a HybridModel '*-*-' over the TE double (processes of
their own: this one keeps TE absent). The run's recipe loads each checkpoint at its step in Bridge's
own set-up, one SNIP measurement, the table and the plans keyed by the model's inventory, their
static recipes (read by Megatron's parser, instantiated as Bridge does) giving every planned module
of the model the analysis built its precision, and nothing written into the checkpoint; the MoE
checkpoint without --recipe, or with a recipe of another model, is refused in one line naming the
fix or the field, with nothing written."""

import json

from snip_megatron.analyze.cli import main
from snip_megatron.errors import run_cli
from snip_megatron.models import gpt
from snip_megatron.plan import Plan
from tests.analyze.analyze_worker import recording
from tests.analyze.helpers import analyze, check_analysis, snapshot
from tests.bridge import tiny
from tests.bridge.runs import worker



def tiny_shape(**changes):
    """The tiny recipe's model shape (tests/bridge/tiny.py), with `changes`."""
    from snip_megatron.shapes import ModelShape

    return ModelShape(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, vocab_size=tiny.VOCAB, seq_length=32).with_(**changes)


def refused(capsys, argv) -> str:
    assert run_cli("snip-analyze", main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("snip-analyze: error: "), lines
    return lines[-1].removeprefix("snip-analyze: error: ")


def trained(cfg, snip=None) -> None:
    """Bridge's pretrain() of `cfg` in this process (with SNIP when `snip` is a SnipConfig)."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from snip_megatron.bridge import enable_snip, run, seams

    pretrain(cfg, forward_step, callbacks=enable_snip(cfg, snip) if snip is not None else [])
    seams.uninstall()
    run.deactivate(run.active())


def analyzed(tmp_path, capsys, monkeypatch, recipe: str, ckpt, budgets: str) -> tuple:
    """snip-analyze of `ckpt` with `recipe` in this process: (its output, {module path: key} of the
    model it built); the checkpoint checked unchanged."""
    from snip_megatron.analyze.megatron_lm import MeasureOnce

    monkeypatch.setattr(MeasureOnce, "on_train_start", recording(tmp_path / "record"))
    before = snapshot(ckpt)
    capsys.readouterr()  # the training's output
    assert run_cli("snip-analyze", main, ["--recipe", recipe, "--load", str(ckpt), "--out", str(tmp_path / "out"),
                                          "--budgets", budgets, "--analyze-microbatches", "2"]) == 0
    assert snapshot(ckpt) == before
    return capsys.readouterr().out, json.loads((tmp_path / "record" / "modules.json").read_text())


def test_a_bridge_moe_checkpoint_is_analyzed_without_writing_into_it(bridge_on_cpu, tmp_path, capsys, monkeypatch):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    trained(tiny.tiny_moe_config(iters=2, save=str(ckpt), save_interval=2))
    before = snapshot(ckpt)
    recipe = "tests.bridge.tiny:tiny_moe_config"
    capsys.readouterr()
    assert refused(capsys, ["--load", str(ckpt), "--out", str(out)]) == (
        f"--load {ckpt}: a Megatron-Bridge checkpoint (run_config.yaml in its iteration folder); give --recipe "
        "MODULE:FUNCTION, the run's recipe, and its overrides")
    assert refused(capsys, ["--recipe", recipe, "model.num_layers=3", "--load", str(ckpt), "--out", str(out)]) == (
        f"--load {ckpt}: the checkpoint holds another model (model.num_layers 2 there, 3 here); give the run's "
        "own recipe and overrides")
    assert not out.exists() and snapshot(ckpt) == before

    printed, modules = analyzed(tmp_path, capsys, monkeypatch, recipe, ckpt, "0.5,0.75")
    assert f"[snip-analyze] {ckpt} at step 2: 2 micro-batches measured" in printed
    experts = gpt.MoEDims(num_experts=4, topk=2, ffn_hidden_size=32)
    keys = [str(k) for k in gpt.inventory(tiny_shape(), moe=experts).keys()]  # every layer: qkv, proj, 2 units
    assert sorted(modules.values()) == sorted(keys + [k for k in keys if "expert" in k] * 3)  # 4 local experts
    doc = check_analysis(out, printed, [0.5, 0.75], linears=8, step=2, modules=modules)
    assert [str(k) for k in Plan.load(out / doc["plans"][0]["files"]["json"])] == keys


def test_a_bridge_mla_checkpoint_with_an_mtp_layer_is_analyzed_by_its_inventory(bridge_on_cpu, tmp_path, capsys,
                                                                               monkeypatch):
    from snip_megatron.config import SnipConfig

    ckpt = tmp_path / "ckpt"
    trained(tiny.tiny_mla_config(iters=2, save=str(ckpt), save_interval=2), SnipConfig(enabled=True, fp4_budget=0.5))
    printed, modules = analyzed(tmp_path, capsys, monkeypatch, "tests.bridge.tiny:tiny_mla_config", ckpt, "0.5,0.6")
    inventory = gpt.inventory(tiny_shape(num_query_groups=4), mla=gpt.MLADims(**tiny.MLA), mtp_num_layers=1)
    assert sorted(modules.values()) == sorted(str(k) for k in inventory.keys())  # 7 per layer, 8 of MTP
    doc = check_analysis(tmp_path / "out", printed, [0.5, 0.6], linears=22, step=2, modules=modules)
    for p in doc["plans"]:  # Megatron keeps FP4 off MTP layers: so do the plans
        plan = Plan.load(tmp_path / "out" / p["files"]["json"]).check_model(inventory)
        assert {v.value for k, v in plan.items() if gpt.is_mtp(k)} <= {"bf16", "fp8"}


def test_a_bridge_hybrid_checkpoint_is_analyzed_over_the_te_double(tmp_path):
    """HybridModelProvider '*-*-' (TE-only stack spec) over the TE double at SM90: keyed by hybrid
    layer, FP8-or-lower budgets (Hopper), the recipes' module paths the pattern's."""
    from snip_megatron.models import hybrid
    from tests.te.te_versions import double_pythonpath

    env = {"PYTHONPATH": double_pythonpath(apex=True), "TE_DOUBLE_COMPUTE_CAPABILITY": "9.0"}
    ckpt = tmp_path / "ckpt"
    worker(tmp_path / "train", "--hybrid", "*-*-", "--iters", "2", "--save", str(ckpt), "--save-interval", "2",
           "--no-snip", env=env)
    before = snapshot(ckpt)
    proc = analyze(tmp_path, tmp_path / "record", "--recipe", "tests.bridge.tiny:tiny_hybrid_config", "--load",
                   str(ckpt), "--out", str(tmp_path / "out"), "--budgets", "0.5,0.75", "--analyze-microbatches", "2",
                   env={**env, "ANALYZE_BRIDGE_CPU": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert snapshot(ckpt) == before
    modules = json.loads((tmp_path / "record" / "modules.json").read_text())
    inventory = hybrid.inventory(tiny_shape(num_layers=4), "*-*-")
    assert sorted(modules.values()) == sorted(str(k) for k in inventory.keys())
    check_analysis(tmp_path / "out", proc.stdout, [0.5, 0.75], linears=8, step=2, kind="fp8_fraction",
                   modules=modules)

