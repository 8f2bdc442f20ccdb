"""Test double of `transformer_engine.pytorch.Linear` (TE 2.14 `module/linear.py`).

Same constructor (arguments the double does not model are refused when switched on), the same
parameters and parallel attributes, the same forward contract: `forward(inp, is_first_microbatch,
fp8_output, fp8_grad)` returns `out`, or `(out, bias)` with `return_bias=True`.
`is_first_microbatch` drives the weight workspace and `fuse_wgrad_accumulation` the weight
gradient's route into `weight.main_grad`, as in TE (module/base.py).
`parallel_mode` 'column' splits the output features over the TP group, 'row' the input features;
communication as in `_parallel`. Row-parallel bias is added after the reduction, as in TE.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from transformer_engine.pytorch.module import _parallel
from transformer_engine.pytorch.module.base import (TransformerEngineBaseModule,
                                                    _refuse_unmodelled,
                                                    set_tensor_model_parallel_attributes)

PARALLEL_MODES = (None, "column", "row")


def _default_init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, mean=0.0, std=0.023)  # TE's default init_method


class Linear(TransformerEngineBaseModule):
    """y = x W^T + b, quantized inside an enabled autocast."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device="cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        _refuse_unmodelled("Linear", ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                           ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                           ub_bulk_wgrad=ub_bulk_wgrad, delay_wgrad_compute=delay_wgrad_compute,
                           symmetric_ar_type=symmetric_ar_type is not None,
                           parameters_split=parameters_split is not None)
        if parallel_mode not in PARALLEL_MODES:
            raise AssertionError(f"parallel_mode {parallel_mode} not supported")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        device = "cpu" if device == "cuda" or isinstance(device, int) else device  # CPU only
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.symmetric_ar_type, self.save_original_input = symmetric_ar_type, save_original_input
        self.ub_name = ub_name
        self._set_tp(tp_group, tp_size)
        self._set_parallel_mode(parallel_mode, sequence_parallel)
        self.weight_names, self.bias_names = ["weight"], ["bias"]

        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                                     device=device, dtype=params_dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                       dtype=params_dtype))
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)  # TE: an empty tensor
        self._init_method = init_method or _default_init
        self.reset_parameters(defer_init=device == "meta")
        # Row parallel: the bias goes on after the TP reduction, so it is not fused in the GEMM.
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init: bool = False) -> None:
        if defer_init:
            return
        self._init_param(self.weight, self._init_method, self.get_rng_state_tracker,
                         self.rng_tracker_name)
        set_tensor_model_parallel_attributes(self.weight, True,
                                             1 if self.parallel_mode == "row" else 0, 1)
        if self.use_bias:
            with torch.no_grad():
                self.bias.zero_()
            if self.parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        if fp8_output or fp8_grad:
            raise NotImplementedError("transformer_engine test double: FP8 outputs / gradients "
                                      "(fp8_output, fp8_grad) are not modelled")
        # TE passes the bias into the GEMM unless it is added after the row reduction or returned
        # (linear.py:1465): the reference NVFP4 GEMM refuses it there.
        gemm_bias = self.bias if self.apply_bias and not self.gemm_bias_unfused_add else None
        spec = self._prepare_forward(inp, lambda recipe: self._forward_checks(recipe, inp, gemm_bias))
        tp = self.tp_size > 1
        x = inp
        if tp and self.parallel_mode == "column":
            x = _parallel.column_input(x, self.tp_group, self.sequence_parallel)
        out = self._gemm(x, gemm_bias, spec, is_first_microbatch=is_first_microbatch,
                         columnwise=torch.is_grad_enabled() and inp.requires_grad,  # linear.py:256
                         overwrite_main_grad=getattr(self.weight, "overwrite_main_grad", False),
                         requires_dgrad=inp.requires_grad)
        if tp and self.parallel_mode == "row":
            out = _parallel.row_output(out, self.tp_group, self.sequence_parallel)
        if self.gemm_bias_unfused_add:
            out = out + self.bias.to(out.dtype)
        if self.return_bias:
            return out, self.bias.to(out.dtype)
        return out
