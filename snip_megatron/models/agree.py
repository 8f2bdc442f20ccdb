"""One global inventory agreed by every rank, from each rank's discovered part.

Each rank discovers only its own layers (its pipeline stage, its virtual chunks); an all-gather
gives every rank every part, so every rank merges the same list and refuses the same mismatch.
"""

from __future__ import annotations

from snip_megatron.models.inventory import Inventory, merge


def agree(local: Inventory, *, expected: "Inventory | None" = None, group=None) -> Inventory:
    """The merged inventory of all ranks (`group`, default the world; alone without a process
    group), checked against `expected` (e.g. the one built from the config) when given.

    Call it at start-up on every rank: ValueError, the same on every rank, when ranks disagree or
    the model does not hold what the config says."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(parts))
        merged = merge(parts, names=[f"rank {r}" for r in ranks])
    else:
        merged = merge([local])
    if expected is not None:
        expected.check_same(merged, what="the model built on these ranks (the config and the built "
                                          "layer spec disagree)")
    return merged


def agree_on_model(model_chunks, expected: Inventory, *, group=None) -> Inventory:
    """The global inventory of the built model: this rank's chunks discovered by `expected`'s
    family adapter, gathered from every rank (one all-gather) and checked against `expected` (the
    inventory the run's config gives, with its sequence_parallel setting). ValueError, the same on
    every rank, naming the first difference: SNIP would otherwise plan a model it does not run."""
    from snip_megatron.models.registry import adapter

    return agree(adapter(expected.family).discover(model_chunks), expected=expected, group=group)
