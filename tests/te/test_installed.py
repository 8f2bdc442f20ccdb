"""The installed Transformer Engine's own answers (version, availability with reasons) at start-up:
read through TE's functions (a stand-in module here: TE is not on CPU; tests/te/double_checks.py
and tests/pretrain/test_te_runs.py read the TE test double's), and what start-up makes of them."""

from __future__ import annotations

import re
import types

import pytest

from snip_megatron.config import SnipConfig
from snip_megatron.te import te_formats
from snip_megatron.te.installed import (Availability, TESupport, support_from, version_notice, version_problem,
                                        version_tuple)

OK = Availability(True)
CUDA_128 = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def te_module(**answers):
    """A stand-in `transformer_engine.pytorch` whose is_*_available(return_reason=True) give `answers`."""
    def check(name):
        ok, reason = answers.get(name, (True, ""))
        return lambda return_reason=False: (ok, reason) if return_reason else ok
    return types.SimpleNamespace(**{f"is_{n}_available": check(n)
                                    for n in ("fp8", "fp8_block_scaling", "mxfp8", "nvfp4")})


def hopper_cuda_128() -> TESupport:
    return support_from(te_module(fp8_block_scaling=(False, CUDA_128), mxfp8=(False, "no MXFP8"),
                                  nvfp4=(False, "no NVFP4")), "2.14.0")


def test_support_is_read_from_tes_functions_with_their_reasons():
    support = hopper_cuda_128()
    assert support.version == "2.14.0" and support.fp8 == OK
    assert support.fp8_block_scaling == Availability(False, CUDA_128)
    assert support.recipe_unavailable("blockwise") == f"Transformer Engine 2.14.0 says: {CUDA_128[:-1]}"
    assert support.recipe_unavailable("tensorwise") is None
    assert support.runnable(["blockwise", "tensorwise", "mxfp8"]) == ["tensorwise"]
    # TE's autocast asserts FP8 support for every recipe, NVFP4 included.
    no_fp8 = support_from(te_module(fp8=(False, "Device compute capability 8.9 or higher required")), "2.14.0")
    assert "8.9 or higher" in no_fp8.recipe_unavailable("nvfp4")


@pytest.mark.parametrize("version, problem, notice", [
    ("2.14.0", False, False), ("2.9.0+70f5366", False, False), ("2.18.1", False, False),
    ("2.8.0", True, False), ("1.13.0", True, False), ("2.19.0", False, True), ("3.0.0.dev0", False, True),
])
def test_te_version_against_the_supported_range(version, problem, notice):
    assert (version_problem(version) is not None) == problem
    assert (version_notice(version) is not None) == notice
    if problem:
        assert "install transformer-engine>=2.9" in version_problem(version)
    with pytest.raises(ValueError, match="not a version number"):
        version_tuple("unknown")


def test_start_up_refuses_what_the_installed_te_says_it_cannot_run_with_the_fix():
    """Blockwise FP8 (the default) on a CUDA 12.8 image: SM90 alone would pass it; TE's own answer
    refuses it at start-up and names the recipe TE runs here."""
    support = hopper_cuda_128()
    assert te_formats(sm=90, uses=("bf16", "fp8"), environ={}).fp8_recipe == "blockwise"  # the table alone
    with pytest.raises(ValueError, match=re.escape(f"fp8_recipe='blockwise': Transformer Engine 2.14.0 says: "
                                                   f"{CUDA_128[:-1]}; choose fp8_recipe tensorwise, or drop fp8")):
        te_formats(sm=90, uses=("bf16", "fp8"), environ={}, support=support)
    assert te_formats(fp8_recipe="tensorwise", sm=90, uses=("bf16", "fp8"), environ={},
                      support=support).fp8_recipe == "tensorwise"
    with pytest.raises(ValueError, match="SnipConfig.fp8_recipe='blockwise': Transformer Engine 2.14.0 says"):
        SnipConfig(enabled=True).resolved("te", sm=90, environ={}, support=support)
    # A Blackwell whose TE says NVFP4 cannot run here: refused, not found at the first FP4 forward.
    no_nvfp4 = support_from(te_module(nvfp4=(False, "Device compute capability 10.0 or higher required")), "2.14.0")
    with pytest.raises(ValueError, match="fp4_recipe='nvfp4': Transformer Engine 2.14.0 says: Device compute"):
        SnipConfig(enabled=True).resolved("te", sm=100, environ={}, support=no_nvfp4)
