"""MoE at one process: an expert unit's row sums its experts' GEMMs, routing is frozen across the
passes, and a measurement leaves training bit-identical (router state and aux losses included)."""

import contextlib

import pytest
import torch

from snip_megatron.megatron.batch import make_forward_step
from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer
from snip_megatron.models import gpt
from snip_megatron.stats import measure as measure_mod
from snip_megatron.stats import routing
from snip_megatron.stats.measure import measure_chunks
from tests.stats.measure_worker import SHAPE, batches, build
from tests.stats.test_untouched import _train_step

pytestmark = pytest.mark.compat

# layer 1 MoE (4 experts, top-2, a gated shared expert), layer 2 dense; expert bias, aux and z losses
# on, so every piece of router state a measurement could touch is live
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0],
           moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
           moe_shared_expert_gate=True)


def _train(measured: bool, steps: int = 3, other_batches: bool = True):
    """`steps` steps on fixed data, a measurement before step 2 (as SNIP's controller runs it), of
    that step's micro-batches or of others (as when it samples some): then the measured routing is
    not proportional to the step's, and token counts leaking into the expert bias would show."""
    chunks = build(**MOE)
    ddp, opt = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-2, clip_grad=1.0,
                                      distributed_optimizer=False)
    tables, fc1_sq = [], None  # fc1_sq: ||W||^2 of layer 1's expert_fc1 experts when measured
    for step in range(steps):
        mbs = batches(seed=step + 1)
        if measured and step == 1:
            measured_mbs = batches(seed=99) if other_batches else mbs
            experts = chunks[0].decoder.layers[0].mlp.experts.local_experts
            fc1_sq = sum(float((e.linear_fc1.weight.double() ** 2).sum()) for e in experts)
            tables.append(measure_chunks(ddp, make_forward_step(), measured_mbs, seq_length=SHAPE.seq_length,
                                         micro_batch_size=2, optimizer=opt))
        _train_step(ddp, opt, mbs)
    state = {n: t.detach().clone() for n, t in [*chunks[0].named_parameters(), *chunks[0].named_buffers()]}
    return state, (tables[0] if tables else None), chunks, fc1_sq


def test_moe_inventory_of_the_built_model_is_the_configs(megatron_single):
    chunks = build(**MOE)
    inv = gpt.of_config(chunks[0].config)
    names = inv.names_by_layer()
    assert names[1] == ("linear_qkv", "linear_proj", "expert_fc1", "expert_fc2", "shared_expert_fc1",
                        "shared_expert_fc2")
    assert names[2] == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    from snip_megatron.megatron.apply import list_planned_linears

    listed = list_planned_linears(chunks)
    assert [str(pl.key) for pl in listed].count("1.expert_fc1") == 4  # one unit, four experts
    assert {pl.key: pl.entry for pl in listed} == {e.key: e for e in inv}


@pytest.mark.parametrize("other_batches", [False, True])
def test_measurement_leaves_moe_training_bit_identical(megatron_single, other_batches):
    with_measure, table, chunks, fc1_sq = _train(True, other_batches=other_batches)
    without, _, _, _ = _train(False)
    assert with_measure.keys() == without.keys()
    assert any("expert_bias" in n for n in with_measure)
    for n in with_measure:
        assert torch.equal(with_measure[n], without[n]), n
    # the expert units' rows: every expert's GEMMs summed, tokens x topk rows in all
    assert table is not None and table.nonfinite() == {}
    inv = gpt.of_config(chunks[0].config)
    tokens = 2 * 2 * SHAPE.seq_length  # two micro-batches of two sequences
    assert table.get(gpt.LayerKey(1, "expert_fc1"), "n") == pytest.approx(tokens * MOE["moe_router_topk"])
    assert table.get(gpt.LayerKey(1, "shared_expert_fc1"), "n") == pytest.approx(tokens)
    assert table.get(gpt.LayerKey(1, "expert_fc2"), "gw_sq") > 0
    # weights and AdamW state: every expert's, in the unit's row
    experts = chunks[0].decoder.layers[0].mlp.experts.local_experts
    fc1 = [e.linear_fc1.weight for e in experts]
    assert table.get(gpt.LayerKey(1, "expert_fc1"), "adam_numel") == sum(w.numel() for w in fc1) == 4 * 64 * 64
    assert table.get(gpt.LayerKey(1, "expert_fc1"), "w_sq") == pytest.approx(fc1_sq, rel=1e-5)
    assert len(table.keys) == len(inv)


def test_an_expert_routed_no_tokens_trains_and_is_measured_in_fp4(megatron_single):
    """Megatron's SequentialMLP hands an expert that no token chose an empty input: the quantized
    linears and the statistics take it (its row adds its weights only)."""
    from snip_megatron.formats.precision import Precision
    from snip_megatron.megatron.apply import apply_plan
    from snip_megatron.plan import Plan

    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.model import build_model_chunks

    runtime.seed_all(1234)
    chunks = build_model_chunks(SHAPE, backend="emulated", **MOE)
    router = chunks[0].decoder.layers[0].mlp.router
    with torch.no_grad():
        router.expert_bias[3] = -1e4  # expert 3 never wins a top-2 (sigmoid scores lie in (0, 1))
    inv = gpt.of_config(chunks[0].config)
    apply_plan(chunks, Plan({k: Precision.FP4 if gpt.is_expert(k) else Precision.FP8 for k in inv.keys()}))
    ddp, opt = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-2, clip_grad=1.0, distributed_optimizer=False)
    before = chunks[0].decoder.layers[0].mlp.experts.local_experts[3].linear_fc1.weight.detach().clone()
    _train_step(ddp, opt, batches(seed=1))
    table = measure_chunks(ddp, make_forward_step(), batches(seed=2), seq_length=SHAPE.seq_length,
                           micro_batch_size=2, optimizer=opt)
    assert table.nonfinite() == {}
    assert table.get(gpt.LayerKey(1, "expert_fc1"), "n") == pytest.approx(2 * 2 * SHAPE.seq_length * 2)
    idle = chunks[0].decoder.layers[0].mlp.experts.local_experts[3].linear_fc1.weight
    assert torch.equal(idle, before)  # no tokens, no gradient, no update


def test_without_freezing_the_routers_a_measurement_changes_training(megatron_single, monkeypatch):
    """The bit-identity above is the routers' doing: left as they are, the measurement's forwards
    add to the expert-bias token counts that training consumes."""

    @contextlib.contextmanager
    def untouched(chunks):
        yield routing._Routes([])

    monkeypatch.setattr(measure_mod.routing, "frozen_routing", untouched)
    with_measure, _, _, _ = _train(True)
    without, _, _, _ = _train(False)
    assert any(not torch.equal(with_measure[n], without[n]) for n in with_measure)


def test_noise_passes_replay_the_clean_passes_routing():
    replay = routing.FrozenRouting()
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3]])

    def topk(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k=k, dim=1)

    probs, idx = replay.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert idx.tolist() == [[1, 2], [0, 2]]
    replay.replay()
    flipped = torch.tensor([[0.9, 0.1, 0.5], [0.1, 0.8, 0.3]])  # noise would route elsewhere
    probs, again = replay.get_replay_topk(flipped, 2, default_compute_topk=topk)
    assert again.tolist() == [[1, 2], [0, 2]] and torch.equal(probs, torch.tensor([[0.1, 0.5], [0.1, 0.3]]))
    with pytest.raises(RuntimeError, match="more micro-batches"):
        replay.get_replay_topk(flipped, 2, default_compute_topk=topk)
