"""MoE models at the layout classes of the support matrix through Megatron-LM's loop on CPU (prod
lane): TE grouped experts (over the TE double) in a DeepSeek-style GPT (MLA + MoE + an MoE MTP layer)
(its TP=2+SP x EP=2 links behind the all-to-all dispatcher) and in a HybridModel ('*EE*'), chained across
layouts and GPU generations as tests/pretrain/test_layouts.py chains the dense models (SM90: BF16/FP8
plans; SM100: FP8/FP4 plans, grouped NVFP4 GEMMs at widths in multiples of 128), and DP=2 with the
distributed optimizer and full recompute on each backend (not resumed: Megatron's distributed
optimizer cannot load a checkpoint without apex or TE's FusedAdam). Every launch measures and
re-plans; every TE linear of every rank runs its plan after every step."""

import json

import pytest

from snip_megatron.plan import Plan
from tests.pretrain import test_mla_runs
from tests.pretrain.test_layouts import DP2, ITERS, analyzed, check_launch, check_ranks
from tests.pretrain.test_runs import MODEL, needs_training, run, state_of
from tests.pretrain.test_te_runs import BLACKWELL_SNIP, DATA, HOPPER_SNIP, WORKER, run_te

pytestmark = pytest.mark.launches

EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128", "--moe-grouped-gemm",
           "--moe-aux-loss-coeff", "1e-2", "--hidden-size", "128", "--ffn-hidden-size", "256"]
GPT = ["--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]", *test_mla_runs.MLA, "--mtp-num-layers", "1",
       "--moe-shared-expert-intermediate-size", "128"]
"""DeepSeek-style: MLA, layers 2-4 and the MTP layer MoE with a shared expert."""
TP_EP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
         "--expert-tensor-parallel-size", "1"]
EXPERT_OPTIMIZER = "--expert-model-parallel-size"
"""A layout with it (EP > 1) is one where Megatron gives the experts' parameters their own optimizer:
its TE expert linears mark them `allreduce = False` only at EP > 1 or ETP != TP (megatron/core/extensions/
transformer_engine.py, TEGroupedLinear: `use_expert_pgs = is_expert and (self.expert_parallel or ...)`), and
get_megatron_optimizer chains a second optimizer for such parameters (megatron/core/optimizer/__init__.py:
`if len(moe_param_groups) > 0:`). The non-distributed optimizer's checkpoint keeps that structure (a sole
optimizer's state as is, several as {0: .., 1: ..}), and Megatron cannot load it into the other one
(megatron/core/optimizer/optimizer.py, ChainedOptimizer.load_state_dict: `if len(self.chained_optimizers)
!= len(state_dict): raise RuntimeError(...)`): a link that moves the experts in or out of their own
optimizer resumes with Megatron's `--no-load-optim` (model, iteration and SNIP's state still load)."""
BASE = {"deepseek": test_mla_runs.MODEL, "hybrid": None}
"""The models' base flags (MLA's without grouped-query attention; None: tests/pretrain/test_runs.MODEL)."""
MODELS = {  # name: (flags at one process, at TP=2+SP x EP=2, at PP=2 x VPP=2, the worker's environment)
    "deepseek": ([*GPT], [*GPT, *TP_EP, "--moe-token-dispatcher-type", "alltoall"],
            [*GPT, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], {}),
    # a chunk per layer at PP=2 x VPP=2, each stage with an MoE layer (rule hybrid-moe-stage-without-experts)
    "hybrid": (["--hybrid-layer-pattern", "*EE*"], ["--hybrid-layer-pattern", "*EE*", *TP_EP],
               ["--hybrid-layer-pattern", "*|E|E|*", "--pipeline-model-parallel-size", "2"],
               {"PROBE_FAMILY": "hybrid"}),
}


@needs_training
@pytest.mark.parametrize("model", sorted(MODELS))
def test_te_grouped_experts_chain_across_layouts_and_generations(tmp_path, model):
    """One process (SM90) -> TP=2+SP x EP=2 (SM90) -> PP=2 x VPP=2 (SM90) -> PP=2 x VPP=2 (SM100) ->
    TP=2+SP x EP=2 (SM100) -> one process (SM100): each link resumes the last one's checkpoint (its
    optimizer only where the experts keep their optimizer: EXPERT_OPTIMIZER), which snip-analyze then
    measures on its GPU (at PP=2 after the virtual-pipeline links)."""
    one, tp_ep, pp, env = MODELS[model]
    ckpt = tmp_path / "ckpt"
    links = [(1, one, 90), (2, tp_ep, 90), (2, pp, 90), (2, pp, 100), (2, tp_ep, 100), (1, one, 100)]
    plan = None
    for i, (nproc, layout, sm) in enumerate(links):
        steps = [3 * i + 1, 3 * i + 2, 3 * i + 3]
        resume = ["--load", str(ckpt)] if plan else []
        if plan and (EXPERT_OPTIMIZER in layout) != (EXPERT_OPTIMIZER in links[i - 1][1]):
            resume.append("--no-load-optim")  # EXPERT_OPTIMIZER: a Megatron limitation
        argv = [*EXPERTS, *layout, *DATA, "--global-batch-size", "8", "--train-iters", "18", "--save-interval", "3",
                "--save", str(ckpt), "--exit-interval", str(steps[-1]), *(HOPPER_SNIP if sm == 90 else BLACKWELL_SNIP),
                *resume]
        out = run_te(tmp_path, [str(WORKER), str(tmp_path / f"p{i}")], *argv, sm=sm, nproc=nproc, timeout=900,
                     model=BASE[model], **env)
        check_launch(out, steps, plan)
        rows = check_ranks(tmp_path / f"p{i}", nproc, steps)
        if model == "deepseek" and layout is tp_ep:  # the dispatcher the flags name
            for rank in range(nproc):
                found = json.loads((tmp_path / f"p{i}" / f"rank{rank}.json").read_text())
                assert found["dispatchers"] == ["MoEAlltoAllTokenDispatcher"], found
        if plan is not None:
            assert rows[0]["plan"] == {str(k): p.value for k, p in plan.items()}
        plan = Plan.from_dict(state_of(ckpt, steps[-1])["plan"])
        assert plan.counts()["bf16" if sm == 90 else "fp4"] > 0, plan.counts()
        if i:  # one process on SM90: tests/analyze/test_models.py
            analyzed(tmp_path, f"a{i}", ckpt, steps[-1], [*EXPERTS, *layout], sm=sm, nproc=nproc,
                     base=BASE[model] or MODEL, kind="fp8_fraction" if sm == 90 else "fp4_fraction")
    assert any(plan[k].value == "fp4" for k in plan.keys() if k.name.startswith("expert_fc"))  # grouped NVFP4
    assert all(plan[k].value != "fp4" for k in plan.keys() if k.name.startswith("mtp."))  # never FP4 in MTP


@needs_training
@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_te_grouped_experts_with_the_distributed_optimizer_and_recompute(tmp_path, model, sm):
    one, _, _, env = MODELS[model]
    argv = [*EXPERTS, *one, *DP2, "--expert-model-parallel-size", "2", *DATA, *ITERS, "--exit-interval", "3",
            *(HOPPER_SNIP if sm == 90 else BLACKWELL_SNIP)]
    out = run_te(tmp_path, [str(WORKER), str(tmp_path / "p")], *argv, sm=sm, nproc=2, timeout=900, model=BASE[model],
                 **env)
    check_launch(out, [1, 2, 3])
    check_ranks(tmp_path / "p", 2, [1, 2, 3])


@needs_training
def test_local_experts_with_the_distributed_optimizer_and_recompute(tmp_path):
    """SequentialMLP experts on the local spec, EP=2 over two data-parallel replicas."""
    argv = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[1,0]",
            "--expert-model-parallel-size", "2", *DP2, *DATA, *ITERS, *BLACKWELL_SNIP, "--exit-interval", "3"]
    check_launch(run(tmp_path, ["-m", "snip_megatron.pretrain"], *argv, nproc=2, timeout=900), [1, 2, 3])
