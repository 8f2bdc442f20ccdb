"""Real CPU runs of Megatron-LM's loop with SNIP (prod lane; megatron.training ships with
megatron-core >= 0.19): SNIP measures, re-plans, writes its state beside every checkpoint (async
saves included) and a resumed run (the latest, or --ckpt-step) takes the plan of the iteration
Megatron loads; Megatron's own model flags, spec, masks and pipeline split keep their effect;
real text over TP=2 with a pinned plan; the patched Megatron-LM main."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snip_megatron.plan import Plan
from snip_megatron.pretrain.state import STATE_FILE
from tests.distributed import ROOT, run_distributed, run_python
from tests.forked import MEGATRON_LM

HAVE_TRAINING = True
try:
    import megatron.training.training  # noqa: F401
except Exception:
    HAVE_TRAINING = False
needs_training = pytest.mark.skipif(
    not HAVE_TRAINING, reason="megatron.training ships only with megatron-core >= 0.19 (prod lane); "
                              "the compat lane checks the clear refusal instead")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
         "--max-position-embeddings", "32", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--tokenizer-type", "NullTokenizer", "--log-interval", "1",
         "--eval-iters", "1"]
# OMP_NUM_THREADS comes from the environment: the lane's share of the cores (scripts/run_tests.sh),
# else tests/conftest.py's default.
ENV = {"PYTHONWARNINGS": "ignore"}


def run(cwd: Path, target: list[str], *argv: str, nproc: int = 1, timeout: float = 420) -> str:
    args = [*target, *MODEL, *argv]
    if nproc > 1:
        return run_distributed(args, nproc=nproc, timeout=timeout, preload=MEGATRON_LM).stdout
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return run_python(args, cwd=cwd, env=env, timeout=timeout, preload=MEGATRON_LM).stdout


def train(cwd: Path, *argv: str, **kw) -> str:
    return run(cwd, ["-m", "snip_megatron.megatron.pretrain_gpt"], *argv, **kw)


def snip_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[snip]")]


def losses(out: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in
            re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", out)}


def state_of(folder: Path, iteration: int) -> dict:
    return json.loads((folder / f"iter_{iteration:07d}" / STATE_FILE).read_text())


def corpus_of(tmp_path: Path, docs: int = 40, words_per_doc: int = 300) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "each linear layer runs in the lowest precision it tolerates and is planned again".split()
    for i in range(docs):  # a small real-text corpus: tokenizer training and indexing take seconds
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(words_per_doc)))
    return corpus


@pytest.mark.launches
@needs_training
def test_snip_replans_saves_its_state_after_each_checkpoint_and_resumes_the_loaded_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    snip = ["--snip", "--snip-warmup", "2", "--snip-interval", "3", "--snip-lag", "1", "--snip-fp4-budget", "0.5"]
    common = ["--mock-data", "--vocab-size", "256", "--eval-interval", "100", "--save-interval", "2",
              "--train-iters", "8", *snip]  # the same schedule in every run; --exit-interval stops early
    out = train(tmp_path, *common, "--exit-interval", "6", "--save", str(ckpt), "--async-save",
                "--tensorboard-dir", str(tmp_path / "tb"))
    lines = snip_lines(out)
    assert ("[snip] on; backend emulated; formats fp8=blockwise fp4=nvfp4; plan: initial fp8 "
            "{'bf16': 0, 'fp8': 8, 'fp4': 0}") in lines
    assert "[snip] rank 0 runs the plan on its 8 planned linears: {'bf16': 0, 'fp8': 8, 'fp4': 0}" in lines
    update = next(line for line in lines if line.startswith("[snip] step 3: plan"))
    assert float(re.search(r"FP4 ([0-9.]+)% of linear FLOPs", update).group(1)) >= 50.0  # the budget
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6] and all(2.0 < x < 7.0 for x in losses(out).values())
    # --async-save: each state is written after Megatron finalised its checkpoint (tracker written)
    saved = [i for i, line in enumerate(out.splitlines()) if "snip_state.json" in line and "saved plan" in line]
    final = [i for i, line in enumerate(out.splitlines()) if "successfully saved checkpoint" in line]
    assert len(saved) == len(final) == 3 and all(s > f for s, f in zip(saved, final))
    s4, s6 = state_of(ckpt, 4), state_of(ckpt, 6)
    assert (s4["iteration"], s4["controller"]["next_measure"]) == (4, 5)
    assert (s6["iteration"], s6["controller"]["next_measure"]) == (6, 8)
    assert Plan.from_dict(s4["plan"]).counts()["fp4"] > 0 and s4["plan_source"] == "initial fp8"
    check_figures_in_tensorboard(tmp_path / "tb", plan_steps=[0, 3, 6], measured_steps=[3, 6], linears=8)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fp4 = EventAccumulator(str(tmp_path / "tb")).Reload().Scalars("snip/flops_fp4")
    assert fp4[0].value == 0.0 and fp4[1].value >= 0.5  # the initial plan (all FP8), then the budget

    # Resume the latest: the model is built with iteration 6's plan, whatever the flags say.
    plan6 = Plan.from_dict(s6["plan"]).counts()
    out = train(tmp_path, *common, "--exit-interval", "7", "--save", str(ckpt), "--load", str(ckpt),
                "--snip-initial-precision", "fp4")
    assert f"[snip] rank 0 runs the plan on its 8 planned linears: {plan6}" in snip_lines(out)
    assert any(line.endswith(f"plan: checkpoint {plan6}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [7]

    # --ckpt-step 4: iteration 4's state, so the measurement of step 5 runs again.
    out = train(tmp_path, *common, "--exit-interval", "6", "--save", str(tmp_path / "again"),
                "--load", str(ckpt), "--ckpt-step", "4")
    plan4 = Plan.from_dict(s4["plan"]).counts()
    assert any(line.endswith(f"plan: checkpoint {plan4}") for line in snip_lines(out)), snip_lines(out)
    assert sorted(losses(out)) == [5, 6]
    assert any(line.startswith("[snip] step 6: plan") for line in snip_lines(out))


def check_figures_in_tensorboard(folder: Path, plan_steps: list, measured_steps: list, linears: int) -> None:
    """SNIP's scalars, heat map and plan table in the run's TensorBoard folder, read back with
    TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"images": 0, "tensors": 0, "scalars": 0}).Reload()
    for tag in ("snip/flops_fp4", "snip/flops_fp8", "snip/flops_bf16", "snip/modelled_speedup",
                "snip/linears_changed"):
        assert [e.step for e in events.Scalars(tag)] == plan_steps, tag
    for tag in ("snip/measure_s", "snip/solve_s", "snip/predicted_cost", "snip/predicted_loss_increase"):
        found = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
        assert [e.step for e in found] == measured_steps, tag
    assert [e.step for e in events.Images("snip/plan_heatmap")] == plan_steps
    tables = events.Tensors("snip/plan_table/text_summary")
    last = tables[-1].tensor_proto.string_val[0].decode().splitlines()
    header = "| layer | linear | precision | previous | Q." if measured_steps else "| layer | linear | precision |"
    assert last[0].startswith(header) and len(last) == 2 + linears


@pytest.mark.launches
@needs_training
def test_megatrons_model_data_and_pipeline_flags_keep_their_effect(tmp_path):
    """Megatron builds the model (--qk-layernorm), the batch (masks, --reset-*, --eod-mask-loss)
    and the pipeline split (--decoder-first-pipeline-num-layers): SNIP's stages are Megatron's."""
    corpus = corpus_of(tmp_path, docs=60, words_per_doc=6)  # short documents: EODs inside a sample
    out = run(tmp_path, [str(ROOT / "tests" / "pretrain" / "pretrain_worker.py"), str(tmp_path / "probe")],
              "--num-layers", "3", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
              "--qk-layernorm", "--corpus", str(corpus / "*.txt"), "--corpus-cache", str(tmp_path / "cache"),
              "--vocab-size", "300", "--split", "90,10,0", "--reset-position-ids",
              "--reset-attention-mask", "--eod-mask-loss", "--train-iters", "2", "--eval-interval", "100",
              "--snip", "--snip-per-stage-budget", "--snip-warmup", "1", "--snip-interval", "10",
              "--snip-lag", "0", "--snip-fp4-budget", "0.5", nproc=2)
    first, last = (json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert sorted(first["planned"]) == ["1.linear_fc1", "1.linear_fc2", "1.linear_proj", "1.linear_qkv"]
    assert sorted({k.split(".")[0] for k in last["planned"]}) == ["2", "3"]  # the uneven split
    assert set(first["planned"].values()) == {"QuantColumnParallelLinear", "QuantRowParallelLinear"}
    assert first["stages"] == {f"{layer}.{n}": (0 if layer == 1 else 1) for layer in (1, 2, 3)
                               for n in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}
    assert first["q_layernorms"] == 1 and last["q_layernorms"] == 2  # --qk-layernorm: one per layer
    assert first["batch"]["attention_mask"] == [2, 1, 32, 32]  # built by the dataloader (its default)
    pos, mask = first["position_ids"], first["loss_mask"]
    restarts = [i for i in range(1, len(pos)) if pos[i] == 0]
    assert restarts, pos  # --reset-position-ids: a new document restarts at 0
    assert all(mask[i - 1] == 0.0 for i in restarts), (restarts, mask)  # --eod-mask-loss: no loss on EOD
    lines = snip_lines(out)
    assert any(line.startswith("[snip] step 1: plan") for line in lines), lines


@pytest.mark.launches
@needs_training
def test_a_user_spec_and_precision_config_are_kept(tmp_path):
    config = tmp_path / "precision.yaml"
    config.write_text("matchers:\n  out:\n    enabled: true\n    type: glob\n    pattern: '*output_layer*'\n"
                      "    config: keep_high\nconfigs:\n  keep_high:\n    precision: bf16\n")
    plan = Plan.uniform(2, "fp8").replace({"1.linear_fc1": "fp4"})
    plan.save(tmp_path / "plan.json")
    run(tmp_path, [str(ROOT / "tests" / "pretrain" / "pretrain_worker.py"), str(tmp_path / "probe")],
        "--spec", "tests.pretrain.custom_spec", "user_layer_spec", "--te-precision-config-file", str(config),
        "--mock-data", "--vocab-size", "256", "--train-iters", "1", "--eval-interval", "100",
        "--snip", "--snip-plan", str(tmp_path / "plan.json"), "--snip-pin-plan")
    probe = json.loads((tmp_path / "probe" / "rank0.json").read_text())
    assert "UserTransformerLayer" in probe["module_types"]  # Megatron built the user's --spec ...
    assert set(probe["planned"].values()) == {"QuantColumnParallelLinear", "QuantRowParallelLinear"}  # ... with SNIP's linears
    assert probe["plan_source"].startswith("pinned")


@pytest.mark.launches
@needs_training
def test_real_text_tp2_pinned_plan(tmp_path):
    corpus = corpus_of(tmp_path)
    pinned = Plan.uniform(2, "fp4").replace({"1.linear_qkv": "fp8", "2.linear_fc2": "bf16"})
    pinned.save(tmp_path / "pin.json")
    out = train(tmp_path, "--tensor-model-parallel-size", "2", "--corpus", str(corpus / "*.txt"),
                "--corpus-cache", str(tmp_path / "cache"), "--vocab-size", "300", "--split", "90,10,0",
                "--train-iters", "3", "--eval-interval", "3", "--save", str(tmp_path / "ckpt"),
                "--save-interval", "3", "--snip", "--snip-plan", str(tmp_path / "pin.json"), "--snip-pin-plan",
                "--tensorboard-dir", str(tmp_path / "tb"), nproc=2)
    assert f"[snip] rank 0 runs the plan on its 8 planned linears: {pinned.counts()}" in out
    assert "validation loss at iteration 3" in out and sorted(losses(out)) == [1, 2, 3]
    state = state_of(tmp_path / "ckpt", 3)
    assert Plan.from_dict(state["plan"]) == pinned and state["plan_source"].startswith("pinned")
    # Megatron's writer is on the last rank, the plan on rank 0: its figures reached the writer.
    check_figures_in_tensorboard(tmp_path / "tb", plan_steps=[0], measured_steps=[], linears=8)


# The main block of Megatron-LM's pretrain_gpt.py (core_v0.19.0) with the patch's SNIP lines, on CPU.
PATCHED_MAIN = """
import sys
from snip_megatron.megatron import add_snip_args
from snip_megatron.megatron.pretrain_gpt import setup_megatron_lm
from snip_megatron.pretrain import cpu, data


# Megatron-LM's own main guard: its checkpoint writer spawns processes that re-import __main__.
if __name__ == "__main__":
    sys.argv = [sys.argv[0]] + cpu.cpu_flags() + sys.argv[1:]
    cpu.patch_arguments_for_cpu()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=lambda parser: add_snip_args(parser),
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    cpu.prepare_cpu(args)  # CPU only; Megatron-LM does this itself on GPUs
    model_cfg = gpt_config_from_args(args)
    setup_megatron_lm(args, model_cfg)
    cpu.skip_prebuilt_helpers()
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, data.datasets_provider, ModelType.encoder_or_decoder, data.forward_step)
"""


@pytest.mark.launches
@needs_training
def test_patched_megatron_lm_main_measures_and_applies(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PATCHED_MAIN)
    out = run(tmp_path, [str(script)], "--mock-data", "--vocab-size", "256", "--train-iters", "4",
              "--eval-interval", "100", "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
              "--snip", "--snip-warmup", "2", "--snip-interval", "10", "--snip-lag", "1")
    lines = snip_lines(out)
    assert "[snip] rank 0 runs the plan on its 8 planned linears: {'bf16': 0, 'fp8': 8, 'fp4': 0}" in lines
    assert any(line.startswith("[snip] step 3: plan") and "solver" in line for line in lines), lines
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert Plan.from_dict(state_of(tmp_path / "ckpt", 4)["plan"]).counts()["fp4"] > 0


@needs_training
def test_bad_snip_settings_fail_before_megatron_starts(capsys):
    from snip_megatron.errors import run_cli
    from snip_megatron.pretrain.entry import main

    for argv, message in ((["--snip-lag", "50", "--snip-interval", "10"],
                           "--snip-lag=50 must be smaller than --snip-interval=10"),
                          (["--snip-fp4-budget", "2"], "--snip-fp4-budget must be a fraction in [0, 1], got 2.0")):
        with pytest.raises(SystemExit) as stop:  # argparse's own exit, one line
            run_cli("snip-pretrain-gpt", main, [*MODEL, "--mock-data", "--snip", *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("snip-pretrain-gpt: error: ") and message in err[-1], err


@pytest.mark.launches
@needs_training
@pytest.mark.parametrize("argv, message", [
    (["--snip-fp4-budget", "1.5"], "--snip-fp4-budget must be a fraction in [0, 1], got 1.5"),
    (["--snip-precisions", "fp4,int8"], "--snip-precisions has unknown precision 'int8'; valid: bf16, fp8, fp4"),
    (["--snip-plan", "/missing/plan.json"], "--snip-plan /missing/plan.json: no such file; give the path of a "
                                            "saved plan"),
    (["--snip-lag", "50", "--snip-interval", "10"], "bad SNIP flags: --snip-lag=50 must be smaller than "
                                                    "--snip-interval=10"),  # values that do not combine
])
def test_the_patched_megatron_lm_main_refuses_a_bad_snip_value_as_it_parses(tmp_path, argv, message):
    """Through Megatron-LM's own parser (the patch's extra_args_provider): argparse refuses the
    value, one line and exit 2, before Megatron validates or prints its arguments."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PATCHED_MAIN)
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = run_python([script, *MODEL, "--mock-data", "--snip", *argv], cwd=tmp_path, env=env, timeout=300,
                      check=False, preload=MEGATRON_LM)
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if "pretrain_gpt.py" in line]
    assert len(ours) == 1 and ours[0].startswith(f"pretrain_gpt.py: error: {message}"), proc.stderr[-3000:]
    assert proc.stdout == "" and "usage:" not in proc.stderr and "Traceback" not in proc.stderr


@needs_training
def test_help_shows_the_flags_generated_from_snipconfig(capsys):
    from dataclasses import fields

    from snip_megatron.config import SnipConfig
    from snip_megatron.flags import field_docs
    from snip_megatron.megatron.args import flag_of
    from snip_megatron.pretrain.entry import main

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--num-layers" in text  # Megatron-LM's own arguments are all there
    for f in fields(SnipConfig):
        first_words = " ".join(field_docs(SnipConfig)[f.name].split()[:6])
        assert flag_of(f.name) in text and first_words in text, f.name


@pytest.mark.compat
def test_refuses_clearly_without_megatron_training(monkeypatch):
    from snip_megatron.errors import MissingDependency
    from snip_megatron.pretrain.entry import require_megatron_training

    monkeypatch.setitem(sys.modules, "megatron.training", None)  # import fails as on megatron-core 0.16
    with pytest.raises(MissingDependency, match=r"needs megatron.training \(shipped with megatron-core >= 0.19\)"
                                                r".*pip install 'megatron-core>=0.19'"):
        require_megatron_training()


@pytest.mark.launches
@pytest.mark.compat
@pytest.mark.skipif(HAVE_TRAINING, reason="this lane has megatron.training: the real runs above cover it")
def test_command_fails_with_the_reason_in_the_compat_lane():
    proc = subprocess.run([sys.executable, "-m", "snip_megatron.megatron.pretrain_gpt", "--snip"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    *notices, error = proc.stderr.strip().splitlines()  # SNIP's start-up notices, then one line
    assert all(line.startswith("[snip] ") for line in notices), proc.stderr
    assert error.startswith("snip-pretrain-gpt: error: Megatron-LM's loop needs megatron.training") and "0.16" in error
