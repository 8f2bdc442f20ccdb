"""AdamW statistics from optimizer state laid out as Transformer Engine's FusedAdam keeps it: the
step count in the param group, and (Megatron's --use-precision-aware-optimizer) moments stored in
BF16 or scaled FP16 on the model's BF16 shard, dequantized before use."""

import pytest
import torch

from snip_megatron.plan import LayerKey
from snip_megatron.stats.adam import adam_statistics

KEY = LayerKey(1, "linear_fc1")


class FusedAdamStateDouble:
    """Test double of TE FusedAdam's state (no TE on CPU): `group["step"]`, moments in
    `name_to_dtype_map` dtypes, FP16 ones with a per-tensor scale in `_scales`, and
    `get_unscaled_state`, FusedAdam's own dequantization, as its source defines it."""

    def __init__(self, param, m, v, step, exp_avg_dtype, exp_avg_sq_dtype):
        self.param_groups = [{"params": [param], "betas": (0.9, 0.95), "eps": 1e-8, "step": step}]
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self._scales = {param: {}}
        self.state = {param: {}}
        for name, value, dtype in (("exp_avg", m, exp_avg_dtype), ("exp_avg_sq", v, exp_avg_sq_dtype)):
            if dtype == torch.float16:
                scale = value.abs().amax() / (torch.finfo(torch.float16).max / 2)
                self._scales[param][name] = scale.reshape(1)
                self.state[param][name] = (value / scale).half()
            else:
                self.state[param][name] = value.to(dtype)

    def get_unscaled_state(self, param, name):
        stored = self.state[param][name]
        if stored.dtype == torch.float16:
            return stored.float() * self._scales[param][name]
        return stored.float()


def _direct(m, v, step, b1=0.9, b2=0.95, eps=1e-8):
    m, v = m.double(), v.double()
    v_hat = v / (1 - b2 ** step)
    denom = v_hat.sqrt() + eps
    c = (1 - b1) / (1 - b1 ** step)
    return {"adam_du_sq": float(((c / denom) ** 2).sum()), "adam_dv_sq": float((v_hat * (c / denom) ** 2).sum()),
            "adam_v_sum": float(v_hat.sum()), "adam_upd_sq": float(((m / (1 - b1 ** step) / denom) ** 2).sum()),
            "adam_numel": float(m.numel())}


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("step", [7, torch.tensor([7], dtype=torch.int32)])  # int, or capturable's tensor
def test_fused_adam_state(dtypes, step):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 32, generator=g))
    m, v = torch.randn(64, 32, generator=g) * 1e-3, torch.rand(64, 32, generator=g) * 1e-6
    opt = FusedAdamStateDouble(w, m, v, step, *dtypes)
    got = {f: float(x) for f, x in adam_statistics(opt, {KEY: w})[KEY].items()}
    want = _direct(opt.get_unscaled_state(w, "exp_avg"), opt.get_unscaled_state(w, "exp_avg_sq"), 7)
    assert got == pytest.approx(want, rel=1e-9)
    # the stored moments are not used raw, and the step is not assumed to be 1
    raw = _direct(opt.state[w]["exp_avg"].float(), opt.state[w]["exp_avg_sq"].float(), 7)
    if dtypes[1] == torch.float16:
        assert got["adam_du_sq"] != pytest.approx(raw["adam_du_sq"], rel=1e-2)
    assert got["adam_upd_sq"] != pytest.approx(_direct(m, v, 1)["adam_upd_sq"], rel=1e-2)


def test_precision_aware_distributed_optimizer_reads_the_bf16_shard_state():
    """With the precision-aware optimizer Megatron's DistributedOptimizer has no FP32 main shard
    (None in shard_fp32_from_float16_groups): FusedAdam's state is keyed by the BF16 shard."""
    g = torch.Generator().manual_seed(1)
    model_param = torch.nn.Parameter(torch.randn(16, 8, generator=g).bfloat16())
    shard = model_param.detach().view(-1)[32:96]
    m, v = torch.randn(64, generator=g) * 1e-3, torch.rand(64, generator=g) * 1e-6
    inner = FusedAdamStateDouble(shard, m, v, 3, torch.bfloat16, torch.float16)

    class DistributedOptimizerDouble:  # the attributes adam.py reads
        optimizer = inner
        model_float16_groups = [[model_param]]
        shard_float16_groups = [[shard]]
        shard_fp32_from_float16_groups = [[None]]
        model_fp32_groups = [[]]
        shard_fp32_groups = [[]]

    got = {f: float(x) for f, x in adam_statistics(DistributedOptimizerDouble(), {KEY: model_param})[KEY].items()}
    want = _direct(inner.get_unscaled_state(shard, "exp_avg"), inner.get_unscaled_state(shard, "exp_avg_sq"), 3)
    assert got == pytest.approx(want, rel=1e-9)
    assert got["adam_numel"] == 64  # this rank's shard only (summed over DP by reduce.py)
