"""The TE double (tests/te_double) is an independent reference, not SNIP (issue 46, item 6):

- it imports no snip_megatron module: by its source (an AST scan) and by running it (a process
  whose imports of snip_megatron fail runs every recipe through Linear, LayerNormLinear and
  GroupedLinear, and ends with no snip_megatron module loaded);
- its quantizers (module/_quantize.py, written from TE's source) agree with torchao's NVFP4 and MX
  casts where TE's rules and torchao's coincide, and the cases where they do not are the ones its
  docstrings name (TE's arithmetic order, subnormal E4M3 scales);
- it would catch a SNIP format that differs from TE's: format_drift_worker.py runs Megatron's TE
  wrappers over the double against SNIP's emulation, as SNIP is and with one rule changed.

The double is importable only in subprocesses (Megatron caches HAVE_TE at import); its
`_quantize.py` imports neither TE nor Megatron, so this process loads that one file by path.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.te.te_versions import double_pythonpath

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = ROOT / "tests" / "te_double"
HERE = Path(__file__).resolve().parent


def _snip_imports(path: Path) -> list[str]:
    """Every snip_megatron module `path` imports, statically or through importlib / __import__."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                  if n == "snip_megatron" or n.startswith("snip_megatron.")]
    return found


def test_the_double_source_imports_no_snip_module():
    files = sorted(DOUBLE.rglob("*.py"))
    assert len(files) > 20, files
    assert [hit for path in files for hit in _snip_imports(path)] == []


_RUN_WITHOUT_SNIP = r"""
import os, sys

class NoSnip:
    def find_spec(self, name, path=None, target=None):
        if name == "snip_megatron" or name.startswith("snip_megatron."):
            raise ImportError(f"the TE double imported {name}")
        return None

sys.meta_path.insert(0, NoSnip())
import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (CustomRecipe, Float8BlockScaling, Float8CurrentScaling,
                                              Format, MXFP8BlockScaling, NVFP4BlockScaling)
from transformer_engine.pytorch.custom_recipes.quantization_nvfp4 import nvfp4_ref_rht_2d_quantizer_factory

g = torch.Generator().manual_seed(0)
x, gy = torch.randn(32, 2, 128, generator=g), torch.randn(32, 2, 32, generator=g)
recipes = [Float8BlockScaling(), Float8CurrentScaling(fp8_format=Format.HYBRID), MXFP8BlockScaling(),
           NVFP4BlockScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True)]
ran = []
for capability, recipe_list in (("10.0", recipes), ("9.0", [CustomRecipe(qfactory=nvfp4_ref_rht_2d_quantizer_factory)])):
    os.environ["TE_DOUBLE_COMPUTE_CAPABILITY"] = capability
    for recipe in recipe_list:
        for make in (lambda: te.Linear(128, 32, bias=False),
                     lambda: te.LayerNormLinear(128, 32, bias=False, normalization="RMSNorm"),
                     lambda: te.GroupedLinear(2, 128, 32, bias=False)):
            module = make()
            if recipe.custom() and isinstance(module, te.GroupedLinear):
                continue  # TE's split quantize takes built-in quantizers only
            xg = x.clone().requires_grad_()
            with te.autocast(enabled=True, recipe=recipe):
                kwargs = {"m_splits": [32, 32]} if isinstance(module, te.GroupedLinear) else {}
                y = module(xg.reshape(64, 128) if kwargs else xg, **kwargs)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(gy.reshape(y.shape))
            assert module.last_run.quantized and xg.grad is not None, (recipe, module)
            ran.append(module.last_run.formats)
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "snip_megatron")
print("RESULT", sorted(set(ran)), loaded)
"""


@pytest.mark.launches
def test_the_double_computes_without_importing_snip():
    """Every modelled recipe (FP8 blockwise, current scaling, MXFP8, NVFP4 with and without
    stochastic rounding, TE's reference NVFP4 CustomRecipe on Hopper), forward and backward, in a
    process whose imports of snip_megatron fail (the venv may have it installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=str(DOUBLE), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _RUN_WITHOUT_SNIP], cwd=str(DOUBLE), env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    assert line == "RESULT ['blockwise', 'mxfp8', 'nvfp4', 'tensorwise'] []", line


# ------------------------------------------------------------------------------------------------
# the double's quantizers against torchao

def _load_quantize():
    path = DOUBLE / "transformer_engine" / "pytorch" / "module" / "_quantize.py"
    spec = importlib.util.spec_from_file_location("te_double_quantize", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


Q = _load_quantize()

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _data(rows=64, cols=256, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.exp(spread * torch.randn(rows, 1, generator=g))


def test_e2m1_nearest_is_torchaos_cast_and_tes_reference_cast():
    """The two E2M1 round-to-nearest casts the double can use agree, ties included: torchao's
    f32_to_f4_unpacked and TE's reference cast_to_fp4x2 thresholds (quantization_nvfp4.py:50-72)."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0])
    y = torch.cat([ties, -ties, _data(4, 64, seed=3).flatten() * 3])
    assert torch.equal(Q._e2m1_nearest(y), Q._e2m1_reference(y.abs()).copysign(y))
    assert torch.equal(Q._e2m1_nearest(ties), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0]))


def test_e2m1_stochastic_rounds_to_a_neighbour_unbiased():
    y = torch.tensor([0.3, 1.2, 2.6, 4.5, 5.9] * 4000)
    u = torch.rand(y.shape, generator=torch.Generator().manual_seed(1))
    q = Q._e2m1_stochastic(y, u)
    assert set(q.unique().tolist()) <= set(_E2M1.tolist())
    lo = torch.tensor([0.0, 1.0, 2.0, 4.0, 4.0] * 4000)
    assert bool(((q == lo) | (q > lo)).all()) and bool((q - y).abs().max() <= 2.0)
    means = q.view(4000, 5).mean(0)
    assert torch.allclose(means, torch.tensor([0.3, 1.2, 2.6, 4.5, 5.9]), atol=0.03), means


@pytest.mark.parametrize("seed,spread", [(0, 1.0), (1, 3.0), (2, 0.0)])
def test_mxfp8_is_torchaos_rceil_cast(seed, spread):
    """MXFP8 (TE: amax * (1/448) rounded up to a power of two from its bits, ptx.cuh:368-398) is
    torchao's to_mx(..., RCEIL) on data where amax / 448 is not within an ulp of a power of two."""
    x = _data(seed=seed, spread=spread)
    ours = Q.quantize(x, Q.TEQuantizer("mxfp8"), columnwise=False)
    exp, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(ours.elements, data.float())
    assert torch.equal(ours.scale_inv, torch.exp2(exp.view(torch.uint8).float() - 127).reshape(ours.scale_inv.shape))


@pytest.mark.parametrize("seed,spread", [(0, 1.0), (1, 0.5), (2, 0.0)])
def test_nvfp4_is_torchaos_two_level_cast_on_fp32_data(seed, spread):
    """NVFP4 row-wise 1x16 (TE's kernel order: S_enc = 2688 / amax, E4M3(block_amax * (S_enc / 6)),
    encode 1 / (scale * S_dec)) gives torchao's nvfp4_quantize codes and E4M3 scales on FP32
    data whose blocks stay above E4M3's smallest normal scale."""
    x = _data(seed=seed, spread=spread)
    ours = Q.quantize(x, Q.TEQuantizer("nvfp4", torch.uint8), columnwise=False)
    assert ours.scale_inv.min() >= 2.0**-6  # torchao raises smaller scales (the next test)
    scales, packed = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))
    assert torch.equal(ours.scale_inv, scales.float().reshape(ours.scale_inv.shape))
    codes = unpack_uint4(packed).reshape(x.shape).long()
    assert torch.equal(ours.elements, _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0))


def test_nvfp4_differs_from_torchao_where_tes_arithmetic_does():
    """Where TE's NVFP4 rule and torchao's (which SNIP follows) part: (1) a BF16 block whose exact
    E4M3 scale is a tie, 448 * 19.5 / 52 = 168 between 160 and 176: torchao divides, (19.5 / 6) /
    (52 / 2688), and lands on the tie (even: 160); TE multiplies 19.5 * (fl(2688 / 52) * fl(1/6)),
    just above it (176) (core_nvfp4.cuh:40-52); (2) a block far below the tensor's amax: TE keeps
    its subnormal E4M3 scale, torchao raises it to 2**-6."""
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 16], x[1, 0] = 52.0, 19.5, 1e-3
    ours = Q.quantize(x.bfloat16(), Q.TEQuantizer("nvfp4", torch.uint8), columnwise=False)
    scales, _ = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))
    torchao = scales.float().reshape(2, 2)
    assert (ours.scale_inv[0, 1].item(), torchao[0, 1].item()) == (176.0, 160.0)
    assert 0 < ours.scale_inv[1, 0].item() < 2.0**-6 == torchao[1, 0].item()


def test_rht_is_tes_matrix_and_rounds_to_the_input_dtype():
    """TE's RHT: diag(TE's signs) H16 / 4 (nvfp4_tensor.py:49-104), orthogonal; BF16 input gives
    BF16-rounded output (hadamard_transform_cast_fusion.cu:473-478)."""
    m = Q.rht_matrix().float()
    assert torch.equal(m @ m.t(), torch.eye(16))
    assert torch.equal(m[:, 0] * 4, Q.wgrad_sign_vector())
    x = _data(8, 64, seed=4)
    y32 = Q.random_hadamard_transform(x, torch.float32)
    assert torch.allclose(y32.view(-1, 16) @ m.t(), x.view(-1, 16), atol=1e-5)
    y16 = Q.random_hadamard_transform(x.bfloat16().float(), torch.bfloat16)
    assert torch.equal(y16, y16.bfloat16().float()) and not torch.equal(y32, y32.bfloat16().float())


def test_scale_rules_follow_te():
    """compute_scale_from_amax (recipe_common.cuh:14-49): max / amax correctly rounded (not the
    reciprocal times max), 1 for zero / inf / NaN amax, pow2 keeps the exponent bits; E8M0 rounds
    up from the bits (ptx.cuh:368-398); exp2f_rcp (ptx.cuh:338-346)."""
    amax = torch.tensor([2.7393507957458496, 0.0, float("inf"), float("nan"), 3.0])
    scale = Q.compute_scale_from_amax(amax, 448.0, False, 0.0, Q.FLOAT32_MAX)
    assert scale[0].item() == (torch.tensor(448.0) / amax[0]).item() != (amax[0].reciprocal() * 448.0).item()
    assert scale[1:4].tolist() == [1.0, 1.0, 1.0]
    assert Q.compute_scale_from_amax(amax[4:], 448.0, True, 0.0, Q.FLOAT32_MAX).item() == 128.0
    e = Q.float_to_e8m0(torch.tensor([1.0, 1.0000001, 0.75, 0.0, float("inf"), float("nan"), 2.0**-127]))
    assert e.tolist() == [127, 128, 127, 0, 254, 255, 0]
    assert Q.exp2f_rcp(torch.tensor([127, 128, 0, 254])).tolist() == [1.0, 0.5, 2.0**127, 2.0**-127]


# ------------------------------------------------------------------------------------------------
# the double catches a SNIP format that differs from TE's

@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    out = tmp_path_factory.mktemp("drift") / "drift.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVTE_", "TE_DOUBLE_"))}
    env.update(PYTHONPATH=double_pythonpath(apex=True), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               SNIP_CPU_KERNEL="0")
    proc = subprocess.run([sys.executable, str(HERE / "format_drift_worker.py"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


def _agreeing(report: dict) -> dict:
    return {key: [name for name in ("y", "dx", "dw") if row[name]] for key, row in report.items()}


@pytest.mark.launches
def test_snip_as_it_is_computes_what_the_double_computes(drift):
    """Megatron's TE wrappers over the double and SNIP's emulation of the plan's formats agree on
    Y, dX and dW: blockwise FP8 bit for bit, NVFP4 (stochastic gradients, shared draws) within a
    few FP32 ulps; current scaling bit for bit."""
    assert {k: v["label"] for k, v in drift["snip_as_is"].items()} == \
        {"1.linear_qkv": "blockwise", "1.linear_proj": "nvfp4"}
    assert _agreeing(drift["snip_as_is"]) == {"1.linear_qkv": ["y", "dx", "dw"], "1.linear_proj": ["y", "dx", "dw"]}
    assert drift["tensorwise_as_is"]["1.linear_qkv"]["label"] == "tensorwise"
    assert _agreeing(drift["tensorwise_as_is"]) == {"1.linear_qkv": ["y", "dx", "dw"]}


@pytest.mark.launches
def test_a_snip_rule_changed_in_snip_only_is_caught(drift):
    """Each rule changed in SNIP only moves exactly the outputs whose GEMMs read it."""
    # FP4 weight tiles: fprop and dgrad read the weight; wgrad does not.
    assert _agreeing(drift["nvfp4_weight_tiles_1x16"]) == {"1.linear_qkv": ["y", "dx", "dw"],
                                                           "1.linear_proj": ["dw"]}
    # Blockwise scales rounded up: every blockwise operand.
    assert _agreeing(drift["pow2_scales_rounded_up"]) == {"1.linear_qkv": [],
                                                          "1.linear_proj": ["y", "dx", "dw"]}
    # SNIP's former Hadamard signs: only NVFP4's wgrad operands are transformed.
    assert _agreeing(drift["hadamard_signs_seeded"]) == {"1.linear_qkv": ["y", "dx", "dw"],
                                                         "1.linear_proj": ["y", "dx"]}
    # SNIP's former scale arithmetic, (1 / amax) * max: an ulp in a scale, caught bit for bit. Here
    # it falls on X's scale (about one amax in three gets one): fprop and wgrad read X, dgrad not.
    assert _agreeing(drift["scale_as_reciprocal_times_max"]) == {"1.linear_qkv": ["dx"]}
