"""Test double of `transformer_engine.pytorch.distributed` (TE 2.14): the RNG tracker and the
recompute flags Megatron imports.

`CudaRNGStatesTracker` follows TE's non-graph-safe path (add / fork / get_states / set_states /
reset, the same errors for a reused seed or name). The double runs on the CPU, so the "CUDA" RNG
states it keeps are CPU generator states: `add` seeds a private generator (the global RNG is left
alone), `fork` swaps the global CPU RNG state in and out.
TE's activation checkpointing (`checkpoint`) is not modelled: it raises NotImplementedError.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict

import torch

_ALL_ACTIVE_RNG_STATES: Dict[str, torch.Tensor] = {}
_FP8_ACTIVATION_RECOMPUTE_ENABLED = False
_FP8_ACTIVATION_RECOMPUTE_PHASE = False


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The states of every tracked RNG (what Megatron checkpoints with the TE tracker)."""
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states: Dict[str, torch.Tensor]) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


def graph_safe_rng_available() -> bool:
    return False


class CudaRNGStatesTracker:
    """Named RNG states; `fork(name)` runs a block under one of them and saves its advance."""

    def __init__(self):
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = states
        set_all_rng_states(self.states_)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()
        set_all_rng_states(self.states_)

    @contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


class activation_recompute_forward:
    """Marks a forward as the first (recompute_phase=False) or second pass of activation
    recomputation; TE's modules read the flags for delayed scaling, which the double does not run."""

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __enter__(self):
        global _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE
        self._saved = (_FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE)
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        _FP8_ACTIVATION_RECOMPUTE_ENABLED = (self.activation_recompute
                                             and FP8GlobalStateManager.is_fp8_enabled())
        _FP8_ACTIVATION_RECOMPUTE_PHASE = self.recompute_phase
        return self

    def __exit__(self, *exc):
        global _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE
        _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE = self._saved
        return False


def is_fp8_activation_recompute_enabled() -> bool:
    return _FP8_ACTIVATION_RECOMPUTE_ENABLED


def in_fp8_activation_recompute_phase() -> bool:
    return _FP8_ACTIVATION_RECOMPUTE_PHASE


def checkpoint(function, *args, **kwargs):
    """TE's activation checkpointing (Megatron's `te_checkpoint`): not modelled by the double."""
    raise NotImplementedError(
        "transformer_engine test double: TE activation checkpointing "
        "(transformer_engine.pytorch.distributed.checkpoint, Megatron's te_checkpoint with "
        "recompute and a global fp8/fp4) is not modelled")
