"""Stochastic-rounding streams are a function of (global layer, step), not of history."""

from snip_megatron.megatron.apply import list_planned_linears
from snip_megatron.megatron.model import build_gpt_model
from snip_megatron.megatron.smoke import SMOKE_SHAPE
from snip_megatron.megatron.sr_seed import reseed_stochastic_rounding, step_seed


def _draws(model):
    return [p.module.sr_stream().next_seed() for p in list_planned_linears(model)]


def test_streams_depend_on_layer_and_step_only(megatron_single):
    model = build_gpt_model(SMOKE_SHAPE)
    for step in (1, 2):                             # history: steps 1 and 2 consume noise
        assert reseed_stochastic_rounding(model, step=step) == 4 * SMOKE_SHAPE.num_layers
        _draws(model)
    reseed_stochastic_rounding(model, step=3)
    first = _draws(model)
    resumed = build_gpt_model(SMOKE_SHAPE)          # a run resumed at step 3 has no history
    reseed_stochastic_rounding(resumed, step=3)
    assert first == _draws(resumed)
    assert len(set(first)) == len(first)            # every layer its own stream
    reseed_stochastic_rounding(model, step=4)
    assert not any(a == b for a, b in zip(first, _draws(model)))


def test_seed_mixes_run_seed_key_and_step():
    seeds = {step_seed(b, k, s) for b in (0, 1) for k in ("1.linear_qkv", "2.linear_qkv") for s in (1, 2)}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)
