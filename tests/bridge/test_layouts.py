"""The layout classes of the support matrix through Megatron-Bridge's pretrain() with enable_snip
(tests/bridge/bridge_worker.py), combined as real runs combine them: each launch measures and
re-plans; each launch of a chain resumes the previous one's checkpoint and starts from its plan.

On Transformer Engine (Megatron's TE linears over the TE double) chains move a run across layouts
and GPU generations as tests/pretrain/test_layouts.py does through Megatron-LM: through SM90 (an
H100: BF16/FP8 plans), then back through SM100 (a B200: FP8/FP4 plans). The dense GPT and
HybridModelProvider's '*-*-': one process -> TP=2 with sequence parallelism x PP=2 (x VPP=2; Bridge
builds no HybridModel under VPP) with full recompute -> the same on SM100 -> one process; beside it
DP=2 x CP=2 (context parallelism: Bridge's gpt_step splits each micro-batch over the CP ranks, TE's
attention runs over both halves) with the distributed optimizer, SM90 -> SM100 (a
distributed-optimizer checkpoint and a plain one do not load into each other). The tiny Qwen3-MoE on
TE's grouped experts (their token splits padded at Bridge's step seam), as a GPT and as the E layers of
HybridModelProvider's '*EE*': one process -> EP=2 -> PP=2, each link loading the model, iteration and
plan (not the optimizer, whose expert part changes with EP); and CP=2 with full recompute -> TP=2
with SP x EP=2 x expert TP=2 and the distributed optimizer (four processes) -> PP=2 x VPP=2 (the GPT
only: Bridge builds no HybridModel under VPP); the tiny DeepSeek-style provider (MLA, grouped
experts with a shared expert, an MoE MTP layer) so at EP=2 (all-to-all) -> PP=2. Multi-latent
attention (MLAModelProvider) with an MTP layer: one process -> CP=2 -> the same on SM100 -> one
process; TP=2 with SP x DP=2 with the distributed optimizer and full recompute, SM90 -> SM100;
PP=2 x VPP=2 (embeddings untied: rule mtp-pp-tied-embeddings), SM90 -> SM100. After every step
every TE linear of every rank runs the controller's plan, with fused wgrad
accumulation and the step's weights (tests/pretrain/test_te_runs.py's checks, through its probe on
Bridge's controller), the ranks' TE linears together are the whole plan, and every core attention
attended its CP share of the queries against all keys.

On the emulated backend (Bridge's local spec with SNIP's linears; no sequence parallelism, which the
local spec's torch norms refuse and MLA needs at TP > 1): MLA with an MTP layer at PP=2 x VPP=2 (the
MTP layer on the last rank), MLA with an MTP layer at DP=2 with the distributed optimizer and full recompute (saved: SNIP's TP-duplicated MLA
down-projections name their DP replicas), the GPT with an MTP layer at TP=2.

Each launch's ranks are forked from one process that imported Bridge once (tests/forked.py).
"""

import json
import math

import pytest

from tests.bridge.runs import launch, losses, results
from tests.pretrain.test_layouts import check_ranks
from tests.pretrain.test_te_runs import te_rows

SCHEDULE = {"warmup": 2, "interval": 3, "lag": 1}
"""Measurements at steps 2, 5, 8, ..., plans at 3, 6, 9, ...: a launch of three steps re-plans once."""
SNIP = {90: {**SCHEDULE, "fp8_budget": 0.5}, 100: {**SCHEDULE, "fp4_budget": 0.5}}
"""Hopper: at least half the linear FLOPs in FP8 (so some linears go to BF16); Blackwell: half in FP4."""
TP_SP, PP_VPP, DISTOPT, RECOMPUTE = ["--tp", "2", "--sp"], ["--pp", "2", "--vpp", "2"], ["--distopt"], ["--recompute"]
CP = ["--cp", "2"]
TP_SP_ETP = [*TP_SP, "--ep", "2", "--etp", "2"]
"""TP=2 with SP x EP=2 x expert TP=2 (four processes: DP=2, each rank two experts' halves)."""
ONE, DP_CP = (1, []), (4, DISTOPT + CP)
MOE, WEIGHTS = ["--model", "moe", "--layers", "2"], ["--weights-only"]
"""The tiny Qwen3-MoE (tests/bridge/tiny.py QWEN3_MOE: 4 experts, top-2, every layer MoE): SequentialMLP
experts on the emulated linears, TE's grouped experts with --te."""
HYBRID_MOE = ["--hybrid", "*EE*", "--model", "moe"]
"""HybridModelProvider's '*EE*' with the tiny Qwen3-MoE's experts (PP=2: '*E' and 'E*', an E layer a stage)."""
HYBRID, MLA, MLA_MTP = ["--hybrid", "*-*-"], ["--model", "mla"], ["--model", "mla", "--mtp", "1"]
MLA_MTP_PP = [*MLA_MTP, "--untied"]
"""MLA with an MTP layer at PP > 1: its embeddings untied, as DeepSeek-V3's (rule mtp-pp-tied-embeddings)."""
DEEPSEEK = ["--model", "deepseek", "--layers", "2", "--mtp", "1"]
"""A tiny DeepSeek-V3-style model (tests/bridge/tiny.py DEEPSEEK_MOE on MLAModelProvider): MLA, MoE
with a shared expert and a sigmoid router with expert bias, one MTP layer."""
TE_CHAINS = {  # test: its chains, each (the worker's model arguments, [(processes, layout)] run at SM90, then back at SM100)
    "dense": [([], [ONE, (4, TP_SP + PP_VPP + RECOMPUTE)]), ([], [DP_CP])],
    "hybrid": [(HYBRID, [ONE, (4, TP_SP + ["--pp", "2"] + RECOMPUTE)]), (HYBRID, [DP_CP])],
    # TE grouped experts; a link that moves the experts in or out of their own optimizer (EP > 1) loads
    # the model, iteration and plan only (Megatron's ChainedOptimizer cannot load the other structure)
    "moe": [(moe, [(1, WEIGHTS), (2, ["--ep", "2", *WEIGHTS]), (2, ["--pp", "2", *WEIGHTS])])
            for moe in (MOE, HYBRID_MOE)],
    "mla_mtp": [(MLA_MTP, [ONE, (2, CP)]), (MLA_MTP, [(4, TP_SP + DISTOPT + RECOMPUTE)]), (MLA_MTP_PP, [(2, PP_VPP)])],
    # CP=2 with full recompute -> TP=2 with SP x EP=2 x expert TP=2 with the distributed optimizer (the
    # model and plan loaded: a distributed-optimizer checkpoint and a plain one do not load into each
    # other) -> the GPT with four layers at PP=2 x VPP=2 (Bridge builds no HybridModel under VPP)
    "moe_wide": [([*MOE, "--layers", "4"], [(2, CP + RECOMPUTE + WEIGHTS), (4, TP_SP_ETP + DISTOPT + WEIGHTS),
                                                (2, PP_VPP + WEIGHTS)]),
                 (HYBRID_MOE, [(2, CP + RECOMPUTE + WEIGHTS), (4, TP_SP_ETP + DISTOPT + WEIGHTS)])],
    # the tiny DeepSeek-style provider (MLA, grouped experts with a shared expert, an MoE MTP layer):
    # EP=2 behind the all-to-all dispatcher -> PP=2, the MTP layer on the last stage
    "deepseek": [(DEEPSEEK, [(2, ["--ep", "2", *WEIGHTS]), (2, ["--pp", "2", *WEIGHTS])])],
}
"""MLA with an MTP layer covers MLA's and MTP's one process, CP, TP, DP, recompute and pipelining."""
EMULATED = [MLA_MTP_PP + PP_VPP, MLA_MTP + DISTOPT + RECOMPUTE, ["--mtp", "1", "--tp", "2"]]
"""Two processes each: MLA with an MTP layer at PP=2 x VPP=2 (untied embeddings); MLA with an MTP
layer at DP=2 (distributed optimizer, full recompute); the GPT with an MTP layer at TP=2."""


def generations(links: list) -> list[tuple[int, list, int]]:
    """SM90 through `links`, then SM100 back through them: (processes, layout, SM) per launch."""
    return [(n, layout, 90) for n, layout in links] + [(n, layout, 100) for n, layout in reversed(links)]


def launch_args(root, i: int, nproc: int, argv: list, *, sm: "int | None", start: int, resume: bool) -> dict:
    """Launch i of the chain under `root`: steps start+1 .. start+3, saved to root/ckpt (loaded from
    it if `resume`); on TE (`sm`) over the double at that generation, the probe in root/p<i>."""
    args = [*argv, "--out", str(root / f"o{i}"), "--iters", str(start + 3), "--snip", json.dumps(SNIP[sm or 100]),
            "--save", str(root / "ckpt"), "--save-interval", "3", *(["--load", str(root / "ckpt")] if resume else [])]
    if sm is None:
        return {"nproc": nproc, "argv": args, "env": {}}
    te = [] if "--hybrid" in argv else ["--te"]  # a HybridModel's linears are TE's whatever
    return {"nproc": nproc, "argv": [*args, *te, "--probe", str(root / f"p{i}")],
            "env": {"TE_DOUBLE_COMPUTE_CAPABILITY": f"{sm // 10}.{sm % 10}"}}


def check_launch(root, i: int, nproc: int, *, sm: "int | None", start: int, resumed: "dict | None",
                 cp: int = 1) -> dict:
    """Launch i trained its three steps (losses in range), re-planned once, at its last step, on
    every rank, every rank ending on one plan, whose linears together (each rank's own) are the whole
    plan; resumed, it started from the checkpoint's plan. On TE every rank's TE linears ran the plan
    after every step, every core attention (TE's, the double's) of every rank attended its 32 / `cp`
    query tokens against all 32 keys, and the plan is the generation's. Returns the plan it ended on."""
    steps = [start + 1, start + 2, start + 3]
    ranks = results(root / f"o{i}")
    assert sorted(ranks) == list(range(nproc)), (root, i)
    found = losses({"ranks": ranks})
    assert sorted(found) == steps and all(2.0 < x < 7.0 and math.isfinite(x) for x in found.values()), found
    plan, covered = ranks[0]["plan"], {}
    for rank in ranks.values():
        assert rank["plan"] == plan
        assert [(h["step"], h["event"]) for h in rank["history"] if h["step"] > start] == [(steps[-1], "update")]
        assert rank["plan_source"] == ("checkpoint" if resumed is not None else "initial fp8")
        assert rank["local_plan"] and all(plan[k] == p for k, p in rank["local_plan"].items())
        covered.update(rank["local_plan"])
    assert sorted(covered) == sorted(plan)
    if sm is None:
        return plan
    rows = check_ranks(root / f"p{i}", nproc, steps)
    assert rows[-1]["plan"] == plan
    for rank in range(nproc):
        attended = [row["attention"] for row in te_rows(root / f"p{i}", rank)]
        assert all(a and all(v == [cp, 32 // cp, 32] for v in a.values()) for a in attended), (rank, attended)
    if resumed is not None:
        assert rows[0]["plan"] == resumed  # the checkpoint's plan from the first step
    used = set(plan.values())
    assert ("bf16" in used and "fp4" not in used) if sm == 90 else ("fp4" in used and "bf16" not in used), used
    return plan


@pytest.mark.parametrize("test", sorted(TE_CHAINS))
def test_te_chains_across_layouts_and_generations(tmp_path, test):
    """Each chain through SM90, then back through SM100 (e.g. one process -> TP x PP x VPP -> the same on
    SM100 -> one process; DP=2 on SM90 -> DP=2 on SM100), all in one launcher."""
    from tests.te.te_versions import double_pythonpath

    launches, checks = [], []
    for c, (argv, links) in enumerate(TE_CHAINS[test]):
        root = tmp_path / f"chain{c}"
        for i, (n, layout, sm) in enumerate(generations(links)):
            launches.append(launch_args(root, i, n, [*argv, *layout], sm=sm, start=3 * i, resume=i > 0))
            checks.append((root, i, n, sm, 2 if "--cp" in layout else 1))
    launch(tmp_path, launches, env={"PYTHONPATH": double_pythonpath(apex=True)})
    plan = None
    for root, i, n, sm, cp in checks:
        plan = check_launch(root, i, n, sm=sm, start=3 * i, resumed=plan if i else None, cp=cp)
    if test == "deepseek":  # the last launch (SM100): grouped NVFP4 experts, the MTP layer never FP4
        assert any(p == "fp4" for k, p in plan.items() if "expert_fc" in k and ".mtp." not in k), plan
        assert all(p != "fp4" for k, p in plan.items() if ".mtp." in k), plan


def test_emulated_mla_and_mtp_layouts(tmp_path):
    """EMULATED's launches, in one launcher."""
    launch(tmp_path, [launch_args(tmp_path / f"run{r}", 0, 2, argv, sm=None, start=0, resume=False)
                      for r, argv in enumerate(EMULATED)], env={})
    for r in range(len(EMULATED)):
        plan = check_launch(tmp_path / f"run{r}", 0, 2, sm=None, start=0, resumed=None)
        if r == 0:  # MTP under VPP: its layer on the last rank (its last virtual stage), never FP4
            local = [set(rank["local_plan"]) for _, rank in sorted(results(tmp_path / "run0" / "o0").items())]
            mtp = {k for k in plan if ".mtp." in k}
            assert mtp and mtp <= local[1] and not mtp & local[0], local
            assert all(plan[k] != "fp4" for k in mtp), plan


def test_emulated_qwen3_moe_at_ep2_resumed_at_pp2_and_etp2_and_at_dp2_and_pp2_vpp2(tmp_path):
    """The tiny Qwen3-MoE on two processes: EP=2 (each rank two experts of every layer; the dense
    parameters over DP=2), saved, then resumed at PP=2 (a layer per stage; the model, iteration and
    SNIP's plan loaded, not the optimizer: at EP > 1 Megatron gives the experts an optimizer of their
    own, which a PP=2 run's single optimizer cannot load), then at expert TP=2 (each expert's linears
    sharded over the two ranks); beside it EP=2 with the distributed optimizer, and four layers at
    PP=2 x VPP=2. Each launch measures with routing frozen and re-plans; the ranks' experts together
    are each layer's routed-expert units."""
    chain, dp, vpp = tmp_path / "chain", tmp_path / "dp", tmp_path / "vpp"
    launch(tmp_path, [launch_args(chain, 0, 2, [*MOE, "--ep", "2"], sm=None, start=0, resume=False),
                      launch_args(chain, 1, 2, [*MOE, "--pp", "2", "--weights-only"], sm=None, start=3, resume=True),
                      launch_args(chain, 2, 2, [*MOE, "--etp", "2", "--weights-only"], sm=None, start=6, resume=True),
                      launch_args(dp, 0, 2, [*MOE, "--ep", "2", *DISTOPT], sm=None, start=0, resume=False),
                      launch_args(vpp, 0, 2, [*MOE, "--layers", "4", *PP_VPP], sm=None, start=0, resume=False)],
           env={})
    plan = check_launch(chain, 0, 2, sm=None, start=0, resumed=None)
    assert {k for k in plan if k.endswith(("expert_fc1", "expert_fc2"))} == \
        {f"{layer}.expert_fc{j}" for layer in (1, 2) for j in (1, 2)}
    plan = check_launch(chain, 1, 2, sm=None, start=3, resumed=plan)
    check_launch(chain, 2, 2, sm=None, start=6, resumed=plan)
    check_launch(dp, 0, 2, sm=None, start=0, resumed=None)
    plan = check_launch(vpp, 0, 2, sm=None, start=0, resumed=None)
    assert {k for k in plan if k.endswith("expert_fc1")} == {f"{layer}.expert_fc1" for layer in range(1, 5)}


def test_emulated_deepseek_style_at_ep2_resumed_at_pp2(tmp_path):
    """Bridge's DeepSeek provider (MLAModelProvider with DeepSeek-V3's MoE fields and an MTP layer):
    EP=2 with the all-to-all dispatcher, saved, then resumed at PP=2 (a layer per stage, the MTP layer
    on the last; the model, iteration and plan loaded, not the optimizer, as for the Qwen3-MoE). Each
    launch measures with routing frozen and re-plans; the plan holds every layer's routed and shared
    experts, MLA's projections and the MTP layer's linears, which stay out of FP4."""
    launch(tmp_path, [launch_args(tmp_path, 0, 2, [*DEEPSEEK, "--ep", "2"], sm=None, start=0, resume=False),
                      launch_args(tmp_path, 1, 2, [*DEEPSEEK, "--pp", "2", "--weights-only"], sm=None, start=3,
                                  resume=True)], env={})
    plan = check_launch(tmp_path, 0, 2, sm=None, start=0, resumed=None)
    assert {f"{layer}.{name}" for layer in (1, 2) for name in ("expert_fc1", "expert_fc2", "shared_expert_fc1",
                                                                "shared_expert_fc2", "linear_q_down_proj")} <= set(plan), plan
    mtp = {k: p for k, p in plan.items() if ".mtp." in k}
    assert mtp and "fp4" not in mtp.values(), plan
    check_launch(tmp_path, 1, 2, sm=None, start=3, resumed=plan)
