"""The keywords Megatron passes to the emulated linears' `_forward_impl`: each one known, honoured or
refused by name, at construction and at the call; none dropped."""

import pytest
import torch

from snip_megatron.emulation import forward_impl
from snip_megatron.emulation.forward_impl import FORWARD_IMPL_KEYWORDS, keywords_passed
from tests.emulation.test_parallel_linear import _pair


def test_this_megatrons_linears_pass_only_known_keywords():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        passed = keywords_passed(cls.forward)
        assert {"input", "weight", "bias", "sequence_parallel", "tp_group"} <= set(passed), passed
        assert set(passed) <= set(FORWARD_IMPL_KEYWORDS), passed


def test_a_megatron_passing_an_unknown_keyword_is_refused_at_construction(megatron_single, monkeypatch, tmp_path):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    source = tmp_path / "newer_layers.py"  # inspect reads a function's source from its file
    source.write_text("def forward(self, input_):\n"
                      "    return self._forward_impl(input=input_, weight=self.weight, fused_remat=2), None\n")
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # noqa: S102
    monkeypatch.setattr(ColumnParallelLinear, "forward", namespace["forward"])
    with pytest.raises(TypeError, match=r"QuantColumnParallelLinear._forward_impl: Megatron passes fused_remat, "
                                        r"which SNIP's emulated linear does not know"):
        _pair()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_an_unknown_keyword_at_the_call_is_refused_by_name(megatron_single, precision):
    layer = _pair()["qcol"]
    layer.set_precision(precision)
    x = torch.randn(4, 128)
    with pytest.raises(TypeError, match=r"Megatron passes wgrad_fusion_v2, which SNIP"):
        layer._forward_impl(input=x, weight=layer.weight, bias=None, wgrad_fusion_v2=True)
    with pytest.raises(TypeError, match="keyword arguments only"):
        layer._forward_impl(x, layer.weight, None)


def test_output_dtype_and_gtp_are_refused_where_the_emulated_gemm_cannot_honour_them(megatron_single):
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    layer = _pair(torch.bfloat16)["qrow"]
    layer.set_precision("fp8")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    kw = dict(input=x, weight=layer.weight, bias=None, gradient_accumulation_fusion=False,
              allreduce_dgrad=False, sequence_parallel=False, tp_group=None, grad_output_buffer=None)
    same = layer._forward_impl(**kw, gtp_remat_size=1, output_dtype=torch.bfloat16)  # main's keywords, honoured
    assert torch.equal(same, layer._forward_impl(**kw))
    with pytest.raises(ValueError, match=r"output_dtype=torch.float32 \(--output-logit-dtype\)"):
        layer._forward_impl(**kw, output_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"gtp_remat_size=2: .*--tensor-parallel-num-weight-shards"):
        layer._forward_impl(**kw, gtp_remat_size=2)
    # at construction: a layer Megatron built GTP-sharded, or as an FP32-logit head
    for setting, words in (({"gtp_remat_size": 4}, "gtp_remat_size=4"), ({"output_dtype": torch.float32},
                                                                          "--output-logit-dtype")):
        built = type("Built", (), {"config": layer.config, **setting})()
        with pytest.raises(ValueError, match=words):
            forward_impl.check_module(built, RowParallelLinear)


def test_the_given_tp_group_carries_the_sequence_parallel_gather(megatron_single, monkeypatch):
    from snip_megatron.emulation import parallel_linear

    layer = _pair()["qcol"]
    layer.set_precision("fp8")
    seen = []
    monkeypatch.setattr(parallel_linear, "gather_from_sequence_parallel_region",
                        lambda t, tensor_parallel_output_grad, group: seen.append(group) or t)
    marker = object()
    layer._forward_impl(input=torch.randn(4, 128), weight=layer.weight, bias=None, sequence_parallel=True,
                        tp_group=marker)
    assert seen == [marker]
