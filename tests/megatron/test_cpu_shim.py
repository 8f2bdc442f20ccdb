"""The CUDA->CPU shim: installs, works, uninstalls cleanly; a no-op where CUDA exists."""

import subprocess
import sys
import textwrap

import pytest
import torch

from snip_megatron.megatron import cpu_shim

CHECK = textwrap.dedent("""
    import torch, torch.cuda.random
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher
    from snip_megatron.megatron import cpu_shim
    names = ["current_device", "synchronize", "current_stream", "default_stream", "Stream", "Event",
             "stream", "get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"]
    before = {n: getattr(torch.cuda, n) for n in names}
    before_m = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, torch.cuda.random.get_rng_state,
                torch.autograd._engine_run_backward)
    before_moe = (token_dispatcher.maybe_move_tensor_to_cpu, mappings._gather_along_first_dim)
    assert cpu_shim.install() is True
    assert cpu_shim.is_installed()
    # the alltoall dispatcher's split sizes come off "the GPU" as numpy, as a GPU copy gives them
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert type(splits).__name__ == "ndarray" and splits.tolist() == [3, 1], splits
    assert torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1])))
    assert mappings._gather_along_first_dim is not before_moe[1]  # its uneven gather over gloo
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).to("cuda:0").device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    # RoPE's context-parallel slice (rope_utils.get_pos_emb_on_this_cp_rank) pins its indices
    assert torch.tensor([1, 2], device="cpu", pin_memory=True).cuda(non_blocking=True).tolist() == [1, 2]
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert not torch.cuda.is_available()
    state = torch.cuda.get_rng_state(); torch.cuda.set_rng_state(state)

    class Recomputed(torch.autograd.Function):  # as Megatron's CheckpointFunction: a backward in a backward
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                y = (x * torch.ones(1, device=torch.cuda.current_device())).sum()
            torch.autograd.backward(y)
            return x.grad * 2 * torch.ones(1, device="cuda")

    leaf = torch.ones(2, requires_grad=True)
    Recomputed.apply(leaf).sum().backward()
    assert leaf.grad.tolist() == [2.0, 2.0]
    with cpu_shim.suspended():  # torch calls bypass the mode: no rewriting, plain type names
        assert torch.ones(1).type() == "torch.FloatTensor"
        assert (torch.ones(3) * 2).sum().item() == 6.0
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"  # and the mode is back after it
    assert cpu_shim.install() is False  # idempotent
    changed = [n for n in names if getattr(torch.cuda, n) is before[n]]
    assert not changed, changed
    cpu_shim.uninstall()
    assert not cpu_shim.is_installed()
    after = {n: getattr(torch.cuda, n) for n in names}
    assert after == before, [n for n in names if after[n] is not before[n]]
    assert (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, torch.cuda.random.get_rng_state,
            torch.autograd._engine_run_backward) == before_m
    assert torch.ones(1).type() == "torch.FloatTensor"
    with cpu_shim.suspended():  # a plain no-op context without the shim
        assert torch.ones(1).type() == "torch.FloatTensor"
    try:
        torch.zeros(1, device="cuda")
    except (RuntimeError, AssertionError) as e:
        print("cuda factory fails again after uninstall:", type(e).__name__)
    else:
        raise SystemExit("cuda factory still redirected after uninstall")
    print("OK")
""")


@pytest.mark.launches
def test_install_uninstall_restores_torch_cuda():
    # A fresh interpreter: other tests in this process keep the shim installed.
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(cpu_shim, "_SAVED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device
    assert cpu_shim.needed() is False
    assert cpu_shim.install() is False
    assert torch.cuda.current_device is before
    assert not cpu_shim.is_installed()
