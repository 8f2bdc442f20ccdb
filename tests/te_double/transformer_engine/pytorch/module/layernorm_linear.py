"""Test double of `transformer_engine.pytorch.LayerNormLinear` (TE 2.14 `module/layernorm_linear.py`).

LayerNorm or RMSNorm fused in front of a Linear: parameters `layer_norm_weight`
(`layer_norm_bias` for LayerNorm), `weight`, `bias`. The norm runs in high precision; inside an
enabled autocast its output is quantized as the GEMM input. With `return_layernorm_output=True`
the forward also returns the (unquantized) norm output, `(out, ln_out)` or `(out, bias, ln_out)`;
with sequence parallelism it is the local shard unless `return_layernorm_output_gathered=True`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from transformer_engine.pytorch.module import _parallel
from transformer_engine.pytorch.module._norm import NORMALIZATIONS, normalize
from transformer_engine.pytorch.module.base import (TransformerEngineBaseModule,
                                                    _refuse_unmodelled,
                                                    set_tensor_model_parallel_attributes)
from transformer_engine.pytorch.module.linear import PARALLEL_MODES, _default_init


class LayerNormLinear(TransformerEngineBaseModule):
    """y = norm(x) W^T + b."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device="cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, name: Optional[str] = None) -> None:
        super().__init__(name)
        _refuse_unmodelled("LayerNormLinear", ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                           ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
                           ub_bulk_dgrad=ub_bulk_dgrad, delay_wgrad_compute=delay_wgrad_compute,
                           symmetric_ar_type=symmetric_ar_type is not None,
                           parameters_split=parameters_split is not None)
        if normalization not in NORMALIZATIONS:
            raise AssertionError("Unsupported normalization type!")
        if parallel_mode not in PARALLEL_MODES:
            raise AssertionError(f"parallel_mode {parallel_mode} not supported")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        device = "cpu" if device == "cuda" or isinstance(device, int) else device  # CPU only
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = (return_layernorm_output_gathered
                                                 if return_layernorm_output else False)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.ub_name = ub_name
        self._set_tp(tp_group, tp_size)
        self._set_parallel_mode(parallel_mode, sequence_parallel)
        self.weight_names, self.bias_names = ["weight"], ["bias"]

        self.layer_norm_weight = torch.nn.Parameter(torch.empty(in_features, device=device,
                                                                dtype=params_dtype))
        if normalization != "RMSNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.empty(in_features, device=device,
                                                                  dtype=params_dtype))
        else:
            self.layer_norm_bias = None
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                                     device=device, dtype=params_dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                       dtype=params_dtype))
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)
        self._init_method = init_method or _default_init
        self.reset_parameters(defer_init=device == "meta")
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init: bool = False) -> None:
        if defer_init:
            return
        with torch.no_grad():
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.layer_norm_bias is not None:
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        self._init_param(self.weight, self._init_method, self.get_rng_state_tracker)
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
        gemm_bias = self.bias if self.apply_bias and not self.gemm_bias_unfused_add else None
        spec = self._prepare_forward(inp, lambda recipe: self._forward_checks(
            recipe, inp.view(-1, inp.shape[-1]), gemm_bias))  # layernorm_linear.py:156-159
        ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, eps=self.eps,
                           normalization=self.normalization,
                           zero_centered_gamma=self.zero_centered_gamma)
        ln_out_return = ln_out
        x = ln_out
        tp = self.tp_size > 1
        if tp and self.parallel_mode == "column":
            x = _parallel.column_input(ln_out, self.tp_group, self.sequence_parallel)
            if self.sequence_parallel and self.return_layernorm_output_gathered:
                ln_out_return = x
        # TE reads overwrite_main_grad on the weight operand (layernorm_linear.py:867): in FP8/FP4
        # the workspace, which never has it; in high precision the parameter itself.
        overwrite = (spec is None and self.weight.dtype == self.activation_dtype
                     and getattr(self.weight, "overwrite_main_grad", False))
        out = self._gemm(x, gemm_bias, spec, is_first_microbatch=is_first_microbatch,
                         columnwise=torch.is_grad_enabled(),  # layernorm_linear.py:298
                         overwrite_main_grad=overwrite, requires_dgrad=True)
        if tp and self.parallel_mode == "row":
            out = _parallel.row_output(out, self.tp_group, self.sequence_parallel)
        if self.gemm_bias_unfused_add:
            out = out + self.bias.to(out.dtype)
        outputs = (out,)
        if self.return_bias:
            outputs += (self.bias.to(out.dtype),)
        if self.return_layernorm_output:
            outputs += (ln_out_return,)
        return outputs[0] if len(outputs) == 1 else outputs
