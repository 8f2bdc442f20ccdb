"""Stochastic-rounding streams that depend on (layer, step) only, so a resumed run rounds like an
uninterrupted one.

Each emulated linear draws its gradient-rounding noise from its own generator. Left running, that
generator's state would depend on every step before it and would have to be checkpointed per
layer and rank. Re-seeding it at every step from the *global* layer key (identical on every TP,
DP and PP rank, whatever the split) and the step number makes the stream a pure function of both:
nothing to save, and pipeline stages never share a stream.
"""

from __future__ import annotations

import zlib

from snip_megatron.megatron.apply import is_emulated_linear, list_planned_linears


def step_seed(base_seed: int, key, step: int) -> int:
    """A 63-bit seed from the run's seed, a layer key (str(LayerKey)) and a step."""
    return zlib.crc32(f"{int(base_seed)}:{key}:{int(step)}".encode()) | (int(step) << 32)


def reseed_stochastic_rounding(model, step: int, base_seed: int = 0) -> int:
    """Seed every emulated linear of `model` (chunks, DDP-wrapped or not) for `step`; returns how many."""
    n = 0
    for planned in list_planned_linears(model):
        if is_emulated_linear(planned.module):
            planned.module.set_sr_seed(step_seed(base_seed, planned.key, step))
            n += 1
    return n
