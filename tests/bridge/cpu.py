"""Bridge's pretrain() on a CPU, for tests (conftest's `bridge_on_cpu` and the torchrun worker).

Megatron-Bridge 0.6.2 assumes a GPU in three spots and its distributed optimizer needs apex or
TE in a fourth; `install()` patches them for the test process only (`uninstall()` undoes it):

- `setup` calls `initialize_megatron` without `allow_no_cuda` (it asserts CUDA): passed True;
- `_set_random_seed` seeds the model-parallel RNG tracker only when it sees a CUDA device, and
  attention forks that tracker: seeded here as well;
- `compile_helpers` runs `make` in megatron/core/datasets, but the megatron-core wheel ships
  the helpers prebuilt and without the Makefile: compiled only when the import fails;
- resuming with the distributed optimizer: without apex/TE, megatron-core's
  `DistributedOptimizer.state_dict` reads Adam's 'step' out of the existing state
  (`assert len(steps) == 1`), even to build the state dict a checkpoint is loaded into, and a
  freshly built optimizer has none. Bridge's `load_checkpoint` gets the zero Adam state a first
  step would make (the compact loop's `init_adam_state`), and afterwards each parameter
  its own Adam step (`own_adam_steps`: the loader hands all parameters one shared step tensor,
  which made the second step after a resume differ). With TE or apex (any GPU install)
  megatron-core keeps 'step' in the param groups instead and neither arises.

The process group is gloo: one rank here, or torchrun's ranks in a worker.
"""

from __future__ import annotations

import functools

from snip_megatron.train.loop import init_adam_state

_UNDO: list = []


def own_adam_steps(optimizer) -> None:
    """After a distributed-optimizer load without apex/TE: every parameter gets its own Adam step
    tensor, set to the step megatron-core restored into the param groups. Its loader gives all
    parameters one shared tensor (and not that value), which torch's Adam then increments once
    per parameter, so the bias correction after a resume would be wrong."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if "step" not in group:  # not the distributed optimizer's non-apex layout
                continue
            for p in group["params"]:
                if p in inner.state:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def _patch(module, name, value) -> None:
    _UNDO.append((module, name, getattr(module, name)))
    setattr(module, name, value)


def install() -> None:
    """gloo process group, the project's CUDA->CPU shim and the four patches above."""
    from snip_megatron.megatron import cpu_shim, runtime

    runtime.quiet_megatron_warnings()
    runtime.init_process_group(backend="gloo", timeout_s=120.0)
    import megatron.bridge.training.checkpointing as bckpt
    import megatron.bridge.training.initialize as binit
    import megatron.bridge.training.setup as bsetup
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_shim.install()
    _patch(bsetup, "initialize_megatron", functools.partial(bsetup.initialize_megatron, allow_no_cuda=True))
    set_random_seed = binit._set_random_seed

    def seed_with_tracker(seed, *args, **kwargs):
        set_random_seed(seed, *args, **kwargs)
        model_parallel_cuda_manual_seed(seed)

    _patch(binit, "_set_random_seed", seed_with_tracker)
    compile_helpers = binit.compile_helpers

    def compile_unless_prebuilt():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            compile_helpers()

    _patch(binit, "compile_helpers", compile_unless_prebuilt)
    load_checkpoint = bckpt.load_checkpoint

    @functools.wraps(load_checkpoint)
    def load_with_adam_state(state, model, optimizer, *args, **kwargs):
        ckpt = state.cfg.checkpoint
        if (optimizer is None or distrib_optimizer.HAVE_APEX_OR_TE or not ckpt.load_optim
                or ckpt.finetune):  # no optimizer state is loaded: nothing to prepare
            return load_checkpoint(state, model, optimizer, *args, **kwargs)
        init_adam_state(optimizer)
        result = load_checkpoint(state, model, optimizer, *args, **kwargs)
        own_adam_steps(optimizer)
        return result

    _patch(bckpt, "load_checkpoint", load_with_adam_state)


def uninstall() -> None:
    """Undo `install()` (patches, shim, parallel state, process group)."""
    import torch.distributed as dist

    from snip_megatron.megatron import cpu_shim, runtime

    while _UNDO:
        module, name, value = _UNDO.pop()
        setattr(module, name, value)
    runtime.destroy()
    cpu_shim.uninstall()
    if dist.is_initialized():
        dist.destroy_process_group()
