"""MoE routers while SNIP measures: routing frozen across the passes, router state left as it was.

Noise in a measurement pass can change a router's top-k choice, and then the noise pass compares
another network with the clean one. So the clean pass records every router's top-k experts and the
noise passes replay them, through Megatron's own replay hook (`Router.router_replay`, consulted by
`topk_routing_with_score_function`); the probabilities are still computed from the current scores,
so gradients flow through the router's input as in training.

Training must not notice a measurement: routers run as in evaluation while measured (no aux, z or
global aux loss, whose gradients would also leak into the backward-noise pass), and every buffer a
router keeps (the expert-bias token counts consumed at the next `finalize_model_grads`, the global
aux loss's counts, ...) is put back afterwards. The measured G_Y therefore lacks the aux-loss term
of training's gradient (docs/moe.md).
"""

from __future__ import annotations

import contextlib


class FrozenRouting:
    """Stands in for a router's `router_replay` during a measurement: records each forward's top-k
    experts while recording, replays them in the same order after `replay()`."""

    def __init__(self):
        self.recorded: list = []
        self.replaying = False
        self.next = 0
        self.layer_number = None  # Megatron's router sets it on its replay object

    def record(self) -> None:
        self.recorded.clear()
        self.replaying, self.next = False, 0

    def replay(self) -> None:
        self.replaying, self.next = True, 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if not self.replaying:
            probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.recorded.append(indices.detach())
            return probs, indices
        if self.next >= len(self.recorded):
            raise RuntimeError(f"router of layer {self.layer_number}: a noise pass routed more micro-batches "
                               f"({self.next + 1}) than the clean pass recorded ({len(self.recorded)})")
        indices = self.recorded[self.next]
        self.next += 1
        if tuple(indices.shape) != (scores.shape[0], topk):
            raise RuntimeError(f"router of layer {self.layer_number}: replayed routing for {indices.shape[0]} "
                               f"tokens, the noise pass routes {scores.shape[0]}")
        return scores.gather(1, indices), indices


def routers(model_chunks) -> list:
    """Every MoE router (Megatron's `Router`) of the chunks."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [m for c in chunks for m in c.modules() if hasattr(m, "router_replay") and callable(getattr(m, "routing", None))]


class _Routes:
    def __init__(self, replays: list):
        self.replays = replays

    def record(self) -> None:
        for r in self.replays:
            r.record()

    def replay(self) -> None:
        for r in self.replays:
            r.replay()


@contextlib.contextmanager
def frozen_routing(model_chunks):
    """While inside: each router records (`.record()`) or replays (`.replay()`) its top-k choices,
    runs without its auxiliary losses, and its buffers come back unchanged afterwards."""
    found = routers(model_chunks)
    saved = [(r, r.training, r.router_replay, {n: b.detach().clone() for n, b in r.named_buffers(recurse=False)
                                                if b is not None})
             for r in found]
    replays = [FrozenRouting() for _ in found]
    try:
        for r, replay in zip(found, replays):
            r.train(False)
            r.router_replay = replay
        yield _Routes(replays)
    finally:
        for r, training, replay, buffers in saved:
            r.train(training)
            r.router_replay = replay
            for name, value in buffers.items():
                getattr(r, name).copy_(value)
