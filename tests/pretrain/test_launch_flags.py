"""snip-pretrain-gpt on a GPU adds the flags for the fused kernels that are not installed, and says so
in one line; with TE and apex it adds none. (CUDA is pretended: the flags are chosen from what is
installed, and Megatron's parser is stopped before it would ask the GPU anything.)"""

import sys

import pytest
import torch

from snip_megatron.pretrain import cpu

ALL = [flag for flag, _ in cpu.GPU_KERNEL_FLAGS]


def _installed(monkeypatch, *modules, rope=False):
    monkeypatch.setattr(cpu, "_importable", lambda name: name in modules)
    monkeypatch.setattr(cpu, "_megatron_has_fused_rope", lambda: rope)


def test_flags_follow_what_is_installed(monkeypatch):
    _installed(monkeypatch)  # a bare GPU image: no TE, no apex
    assert list(cpu.missing_gpu_kernels()) == ALL
    _installed(monkeypatch, "apex", "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda",
               "scaled_upper_triang_masked_softmax_cuda", rope=True)  # NGC: TE and apex
    assert cpu.missing_gpu_kernels() == {}
    _installed(monkeypatch, "apex", rope=True)  # apex without its CUDA extensions
    assert list(cpu.missing_gpu_kernels()) == ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]


def test_this_machine_lacks_every_kernel():
    # The CPU test machine has neither TE nor apex: the probes themselves say so.
    assert list(cpu.missing_gpu_kernels()) == ALL


def test_one_line_on_the_first_rank_only(monkeypatch):
    _installed(monkeypatch)
    lines = []
    monkeypatch.setenv("RANK", "0")
    assert cpu.gpu_flags(lines.append) == ALL
    assert len(lines) == 1 and all(flag in lines[0] for flag in ALL) and "Transformer Engine" in lines[0]
    monkeypatch.setenv("RANK", "3")
    assert cpu.gpu_flags(lines.append) == ALL and len(lines) == 1
    _installed(monkeypatch, "apex", "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda",
               "scaled_upper_triang_masked_softmax_cuda", rope=True)
    monkeypatch.setenv("RANK", "0")
    assert cpu.gpu_flags(lines.append) == [] and len(lines) == 1  # nothing added, nothing said


def test_entry_point_adds_them_on_cuda(monkeypatch, capsys):
    pytest.importorskip("megatron.training")
    import megatron.training.arguments as marguments

    from snip_megatron.pretrain import entry

    monkeypatch.setattr(sys, "argv", [sys.argv[0]])  # Megatron parses sys.argv: restored after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(marguments, "parse_and_validate_args", lambda **kw: sys.argv[1:])
    monkeypatch.delenv("RANK", raising=False)
    _installed(monkeypatch)
    user = ["--transformer-impl", "local", "--num-layers", "2"]
    assert entry.parse_megatron_args(user) == ALL + user  # the user's flags come last: they win
    out = capsys.readouterr().out
    assert out.count("[snip]") == 1 and "--no-rope-fusion" in out
    assert "--use-cpu-initialization" in cpu.CPU_FLAGS  # a CPU flag, not given on a GPU:
    assert "--use-cpu-initialization" not in entry.parse_megatron_args(user)
