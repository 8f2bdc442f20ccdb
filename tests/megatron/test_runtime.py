"""snip_megatron.megatron.runtime: Megatron's parallel state up and down, in one process."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from snip_megatron.megatron import runtime


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_repeated_setup_and_teardown_leaves_no_process_groups_behind():
    # Megatron's destroy_model_parallel forgets most of its groups without destroying them; on gloo
    # each kept its worker threads (about 60 threads per setup, 3,900 over the test suite).
    runtime.init_process_group()
    runtime.initialize_model_parallel(tp=1, pp=1)  # the first setup also starts one-off threads
    runtime.destroy()
    groups, threads = len(_world.pg_map), _threads()
    for _ in range(3):
        runtime.initialize_model_parallel(tp=1, pp=1)
        assert len(_world.pg_map) > groups  # Megatron's groups exist while the state is up
        runtime.destroy()
    assert len(_world.pg_map) == groups
    assert _threads() <= threads + 2  # without the teardown: about 180 more
    assert dist.is_initialized()  # the default group stays: destroy(process_group=True) ends it


def test_setting_up_twice_replaces_the_first_setup_groups():
    runtime.init_process_group()
    runtime.initialize_model_parallel(tp=1, pp=1)
    once = len(_world.pg_map)
    runtime.initialize_model_parallel(tp=1, pp=1)
    assert len(_world.pg_map) == once
    runtime.destroy()
