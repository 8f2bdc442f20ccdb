"""Transformer Engine backend: a plan's precisions as per-module TE quantization configs.

    gpu.py          what each GPU generation runs through TE (by compute capability), its GEMM costs
    installed.py    the installed TE's own answers: its version and availability checks, with reasons
    environment.py  the recipe switches TE reads from its environment at import
    resolve.py      the run's one Formats value on TE (checked at start-up), the start-up line
    translate.py    precision -> TEQuantizationParams dict (and the emulated linears' dict)
    checks.py       TransformerConfig settings that cannot switch precision per layer

All of it is pure Python (tested on CPU); only the TE linears that read the dicts need a GPU.
"""

from snip_megatron.te.checks import check_transformer_config
from snip_megatron.te.gpu import current_sm, fp4_unavailable, fp8_unavailable, gemm_cost, generation
from snip_megatron.te.installed import TESupport, read_te_support
from snip_megatron.te.options import TEOptions
from snip_megatron.te.resolve import te_formats, what_runs
from snip_megatron.te.translate import (emulated_params, precision_of_te_params, te_config_dict, te_params,
                                        te_recipe, te_unavailable)

__all__ = [
    "TEOptions", "TESupport", "check_transformer_config", "current_sm", "emulated_params", "fp4_unavailable",
    "fp8_unavailable", "gemm_cost", "generation", "precision_of_te_params", "read_te_support", "te_config_dict",
    "te_formats", "te_params", "te_recipe", "te_unavailable", "what_runs",
]
