"""Test doubles of `transformer_engine.pytorch.RMSNorm` and `LayerNorm` (TE 2.14
`module/rmsnorm.py`, `module/layernorm.py`): the constructor (with the deprecated `hidden_size`
and `params_dtype` names Megatron 0.16 still passes), `weight` (and `bias`) parameters carrying
Megatron's `sequence_parallel` flag, and the forward in FP32 written back in the input dtype.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from transformer_engine.pytorch.module._norm import normalize


class _Norm(torch.nn.Module):
    normalization = ""
    has_bias = False

    def __init__(self, normalized_shape: Union[Iterable[int], int, None] = None,
                 eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, device=None, dtype=None,
                 sm_margin=0) -> None:
        super().__init__()
        if normalized_shape is None:
            if hidden_size is None:
                raise RuntimeError("Neither `normalized_shape` nor `hidden_size` (deprecated) "
                                   "args are provided")
            normalized_shape = hidden_size
        elif hidden_size is not None:
            raise RuntimeError("Both `normalized_shape` and `hidden_size` (deprecated) args "
                               "are provided")
        if params_dtype is not None and dtype is not None:
            raise RuntimeError("Both `dtype` and `params_dtype` (deprecated) kwargs are provided")
        dtype = params_dtype or dtype or torch.get_default_dtype()
        device = "cpu" if device is None or device == "cuda" or isinstance(device, int) else device
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise NotImplementedError("transformer_engine test double: norms over more than the "
                                      "last dimension are not modelled")
        self.normalized_shape = shape
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = (torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
                     if self.has_bias else None)
        if device != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()
        if self.sequence_parallel is not None:  # custom Megatron-LM integration, as in TE
            for param in self.parameters():
                param.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return normalize(inp, self.weight, self.bias, eps=self.eps,
                         normalization=self.normalization,
                         zero_centered_gamma=self.zero_centered_gamma)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * gamma."""

    normalization = "RMSNorm"


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta."""

    normalization = "LayerNorm"
    has_bias = True
