"""Test double of `transformer_engine.pytorch.GroupedLinear` (TE 2.14 `module/grouped_linear.py`):
the MoE expert GEMMs Megatron's TEGroupedLinear / TEGroupedMLP run.

Same constructor (options the double does not model are refused), parameters `weight0..weight{n-1}`
(and `bias<i>`, or empty tensors without bias) with Megatron's parallel attributes, the same
forward contract: `forward(inp, m_splits, is_first_microbatch)` splits the rows of `inp` by
`m_splits` (one GEMM per split, `len(m_splits) == num_gemms`) and returns `out` ([sum(m_splits),
out_features]) or, with `return_bias=True`, `(out, [bias<i>])`.

Inside an enabled autocast the module holds ONE recipe (the module's, as every TE module), and
each GEMM gets quantizers of its own (`_get_quantizers`, grouped_linear.py:1195-1240): scales per
expert, format shared. The double runs each split through the same quantized GEMMs as `Linear`
(`base._gemm`: the recipe's quantizers, `_gemm.py`; the weight workspace cached per GEMM under
"weight<i>" as `is_first_microbatch` asks, grouped_linear.py:170-183, and the weight gradient
routed into `weight<i>.main_grad` under `fuse_wgrad_accumulation`, grouped_linear.py:386-520,
`overwrite_main_grad` read on weight0 as TE does). A split with no rows runs no quantizer (TE's
split quantize hands it an empty tensor): the double gives it the plain GEMM, whose weight gradient
is zero (routed as any other).

TE's refusals of a quantized grouped forward, checked on every split before any GEMM runs:
- FP8 (current scaling, blockwise): the grouped FP8 GEMMs need every split's rows to be a multiple
  of 16 (cuBLAS FP8 leading dims; TE leaves the padding to the caller, Megatron's `Fp8Padding` and
  `get_fp8_align_size`, megatron/core/fp8_utils.py:318-323);
- MXFP8: every split's rows and the features a multiple of 32 (TE csrc/quantizer.cpp:1349-1351
  on each split's tensor; TE issue #2966);
- NVFP4: every split a multiple of 32 (the FP4 GEMMs' 16-byte TMA alignment along the token dim
  of the wgrad GEMM; Megatron's `get_fp4_align_size`, fp4_utils.py:176-205, pads to 128) and its
  dims multiples of 16 (each split's quantizer). An inner dim that is not a multiple of 128 is not
  refused: `tex.split_quantize` then warns once and quantizes each split on its own, through the
  quantizer a dense linear uses (csrc/extensions/cast.cpp:1425-1437, 1467; the fused kernel's
  "NVFP4 multi-quantize requires inner dim to be multiple of 128", :1293-1294, is on the fused
  path only); the double runs every split as one GEMM of its own anyway, and warns as TE does;
- a CustomRecipe (TE's reference NVFP4 factory): GroupedLinear has no custom-quantizer branch in
  TE 2.14, and `tex.split_quantize` refuses the reference quantizers (csrc/common.cpp:51-64).
Each raises RuntimeError (TE's NVTE_CHECK / kernel errors are RuntimeErrors), recorded in `last_run`.
`last_splits` keeps the m_splits of the last forward and `gemm_runs` each GEMM's weight workspace
(an empty split's too: TE takes every GEMM's, whatever its split), for tests.

Extra state: every module's (base.py `get_extra_state` / `set_extra_state`, per TE version), which
Megatron's TEGroupedLinear splits per expert in its sharded state dict.

Not modelled: a single grouped weight or bias (`single_grouped_weight` / `single_grouped_bias`,
TE >= 2.14's GroupedTensor), delayed wgrad (`delay_wgrad_compute` / `backward_dw`), userbuffers,
FP8 parameters, CPU offloading, TE's debug quantizers; TP inside the module (Megatron's
TEGroupedLinear hands TE no TP group when experts are split, the dispatcher communicates).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Callable, List, Optional

import torch

from transformer_engine.common.recipe import Recipe
from transformer_engine.pytorch.module.base import (TransformerEngineBaseModule, _check_quantizable,
                                                    _storage, set_tensor_model_parallel_attributes)
from transformer_engine.pytorch.module.linear import PARALLEL_MODES, _default_init
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

SPLIT_ALIGNMENT = {"float8": 16, "float8_blockwise": 16, "mxfp8": 32, "nvfp4": 32}
"""The rows each split of a quantized grouped forward must be a multiple of, by TE's storage class
(see the module docstring)."""


_UNFUSED_NVFP4_WARNED = []


def _warn_unfused_nvfp4() -> None:
    """TE's once-per-process NVTE_WARN (csrc/extensions/cast.cpp:1426-1432, std::call_once)."""
    if not _UNFUSED_NVFP4_WARNED:
        _UNFUSED_NVFP4_WARNED.append(True)
        warnings.warn("Unfused NVFP4 quantization fallback is triggered because the input tensor inner dimension "
                      "is not a multiple of 128, disabling NVFP4 grouped kernel fusion. NVFP4 might bring "
                      "performance regressions for this input tensor shape.")


def check_splits(recipe: Recipe, inp: torch.Tensor, m_splits: List[int]) -> None:
    """TE's refusals of `m_splits` (and the inner dim) for a grouped forward under `recipe`."""
    storage = _storage(recipe)
    if storage == "reference_nvfp4":
        raise RuntimeError("Unexpected type for quantizer: GroupedLinear's split quantize takes TE's "
                           "built-in quantizers only (CustomRecipe quantizers are not supported)")
    features = inp.shape[-1]
    if storage == "nvfp4" and features % 128:
        _warn_unfused_nvfp4()
    align = SPLIT_ALIGNMENT[storage]
    for i, rows in enumerate(m_splits):
        if rows % align:
            raise RuntimeError(f"{storage} grouped GEMM: split {i} has {rows} rows, not a multiple of "
                               f"{align} (m_splits={list(m_splits)}); pad the token splits")
        if rows and storage in ("mxfp8", "nvfp4"):
            _check_quantizable(storage, inp.new_empty((rows, features)))


class GroupedLinear(TransformerEngineBaseModule):
    """num_gemms linears y_i = x_i W_i^T + b_i on the row splits x_i of one input."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device="cuda", ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name)
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("GroupedLinear doesn't support Userbuffer overlap.")
        unmodelled = [k for k, v in dict(delay_wgrad_compute=delay_wgrad_compute,
                                         single_grouped_weight=single_grouped_weight,
                                         single_grouped_bias=single_grouped_bias).items() if v]
        if unmodelled:
            raise NotImplementedError(f"transformer_engine test double: GroupedLinear({', '.join(unmodelled)}) "
                                      "is not modelled")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        device = "cpu" if device == "cuda" or isinstance(device, int) else device  # CPU only
        self.params_dtype = params_dtype
        self.num_gemms = num_gemms
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.ub_name, self.save_original_input = ub_name, save_original_input
        self.single_grouped_weight = self.single_grouped_bias = False
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self._set_tp(tp_group, tp_size)
        if self.tp_size > 1 and bias:
            raise ValueError("GroupedLinear doesn't support bias when TP > 1. "
                             "Because the TP communication is handled outside of this module.")
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode {parallel_mode!r} not supported.")
        self._set_parallel_mode(parallel_mode, sequence_parallel)
        self._init_method = init_method or _default_init
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(
                self.out_features, self.in_features, device=device, dtype=params_dtype)))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(
                    self.out_features, device=device, dtype=params_dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=params_dtype, device=device))
        self.last_splits: Optional[list] = None
        self.gemm_runs: list = []
        self.reset_parameters(defer_init=device == "meta")

    def reset_parameters(self, defer_init: bool = False) -> None:
        if defer_init:
            return
        for i in range(self.num_gemms):
            weight = getattr(self, f"weight{i}")
            self._init_param(weight, self._init_method, self.get_rng_state_tracker, self.rng_tracker_name)
            set_tensor_model_parallel_attributes(weight, True, 1 if self.parallel_mode == "row" else 0, 1)
            if self.use_bias:
                with torch.no_grad():
                    getattr(self, f"bias{i}").zero_()

    def _get_weight_tensors(self) -> list:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _get_bias_tensors(self) -> list:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    # -- TE's fp8 metadata and extra state (base.py) ---------------------------------------------
    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """base.py:1013-1037 as far as a module outside an autocast goes: the flags and the
        checkpoint switch (the quantizer state is made at the next quantized forward)."""
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        self.fp8_meta["fp8_checkpoint"] = self.fp8 or self.fp8_calibration
        self.fp8_meta["num_gemms"] = num_gemms

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, m_splits: List[int], is_first_microbatch: Optional[bool] = None):
        m_splits = [int(m) for m in m_splits]
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"Number of splits ({len(m_splits)}) should match number of"
                             f" GEMMs ({self.num_gemms}).")
        if inp.size(-1) != self.in_features:
            raise ValueError(f"Input tensor (shape={tuple(inp.size())}) is not compatible with "
                             f"weight tensor (shape={tuple(self.weight0.size())})")
        inp_view = inp.reshape(-1, self.in_features)
        if sum(m_splits) != inp_view.shape[0]:
            raise RuntimeError(f"split sections {m_splits} do not add up to the input's "
                               f"{inp_view.shape[0]} rows")
        spec = self._prepare_forward(inp, lambda recipe: check_splits(recipe, inp_view, m_splits))
        self.last_splits = list(m_splits)
        weights, biases = self._get_weight_tensors(), self._get_bias_tensors()
        overwrite = getattr(weights[0], "overwrite_main_grad", False)  # grouped_linear.py:478-480
        columnwise = torch.is_grad_enabled() and inp.requires_grad
        outs, runs = [], []
        for i, x in enumerate(torch.split(inp_view, m_splits)):
            gemm_bias = biases[i] if self.apply_bias else None
            out = self._gemm(x, gemm_bias, spec if x.shape[0] else None,
                             is_first_microbatch=is_first_microbatch, columnwise=columnwise,
                             overwrite_main_grad=overwrite, requires_dgrad=inp.requires_grad,
                             weight=weights[i], cache_name=f"weight{i}")
            if spec is not None and not x.shape[0]:
                # TE takes every GEMM's weight workspace, an empty split's too (grouped_linear.py
                # forward: get_weight_workspace for i in range(num_gemms)), so its cache follows the
                # micro-batches as the others' do; the zero-row GEMM itself computes nothing
                _, how = self._weight_workspace(weights[i], _storage(self._held_recipe), is_first_microbatch,
                                                columnwise, f"weight{i}")
                self.last_run = replace(self.last_run, weight_workspace=how)
            runs.append(self.last_run.weight_workspace if spec is not None else "none")
            outs.append(out)
        self.gemm_runs = runs
        if spec is not None:
            self.last_run = replace(self.last_run, weight_workspace=runs[-1])
        out = torch.cat(outs) if outs else inp_view.new_empty((0, self.out_features))
        if self.return_bias:
            return out, [b.to(out.dtype) for b in biases]
        return out
