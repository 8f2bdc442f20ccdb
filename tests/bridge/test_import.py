"""The bridge lane imports Megatron-Bridge without Transformer Engine, and SNIP imports beside it."""

import dataclasses
import importlib.metadata
import importlib.util
import os
import sys

import pytest

LORA_LAYERS = "megatron.bridge.peft.lora_layers"


def test_megatron_bridge_imports_with_te_absent():
    import megatron.bridge

    assert importlib.metadata.version("megatron-bridge") == "0.6.2"
    assert megatron.bridge.AutoBridge is not None
    assert getattr(sys.modules[LORA_LAYERS], "IS_TEST_STAND_IN", False)  # the one module replaced
    assert importlib.util.find_spec("transformer_engine") is None
    assert "transformer_engine" not in sys.modules


def test_megatron_core_builds_without_te():
    import megatron.bridge  # noqa: F401
    from megatron.core.models.gpt import gpt_layer_specs

    assert gpt_layer_specs.HAVE_TE is False
    assert "transformer_engine" not in sys.modules  # importing Bridge did not pull TE in


def test_pretrain_and_gpt_provider_import():
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert callable(pretrain)
    assert issubclass(GPTModelProvider, TransformerConfig) and callable(GPTModelProvider.provide)
    assert "model" in {f.name for f in dataclasses.fields(ConfigContainer)}


def test_lora_stand_in_refuses_to_build_and_names_itself():
    from megatron.bridge.peft.lora import LoRA  # imports the stand-in's names
    from megatron.bridge.peft.lora_layers import LinearAdapter, LoRALinear

    assert LoRA is not None
    assert not isinstance(object(), LoRALinear)
    with pytest.raises(RuntimeError, match="stand-in"):
        LinearAdapter()


def test_snip_controller_and_planner_import_and_solve_with_the_lanes_cbc():
    import pulp
    from packaging.version import Version

    import snip_megatron.controller  # noqa: F401
    from snip_megatron.formats.precision import Precision as P
    from snip_megatron.plan import all_keys
    from snip_megatron.planner import PlannerConfig, cbc_available, solve_plan
    from snip_megatron.planner.ilp import _cbc_command

    assert cbc_available()
    if Version(pulp.__version__) < Version("4"):  # nvidia-modelopt asks PuLP < 4: CBC ships inside
        cbc = _cbc_command(PlannerConfig()).path
        assert os.path.dirname(pulp.__file__) in os.path.realpath(cbc)
    keys = all_keys(2)  # 8 linears; FP4 is dear on the attention linears, cheap on the MLP
    flops = {k: 1000.0 for k in keys}
    costs = {k: {P.FP8: 0.0, P.FP4: 1.0 if "fc" not in k.name else 0.1} for k in keys}
    result = solve_plan(costs, flops, PlannerConfig(rho=0.5))
    assert result.solver == "cbc" and result.status == "optimal"
    assert result.achieved.fp4_fraction == pytest.approx(0.5)
    assert {k for k in keys if result.plan[k] is P.FP4} == {k for k in keys if "fc" in k.name}
    exact = solve_plan(costs, flops, PlannerConfig(rho=0.5, solver="exact"))
    assert exact.plan == result.plan
