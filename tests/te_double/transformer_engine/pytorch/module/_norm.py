"""LayerNorm / RMSNorm arithmetic shared by the norm modules and LayerNormLinear.

TE's kernels normalise in FP32 and write the activation dtype; so does the double (in at least
FP32: a float64 input stays float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalize(x: torch.Tensor, weight: torch.Tensor, bias: "torch.Tensor | None", *, eps: float,
              normalization: str, zero_centered_gamma: bool) -> torch.Tensor:
    """y = norm(x) * gamma (+ beta) over the last dim; gamma = 1 + weight if zero-centred."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    if normalization == "RMSNorm":
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    elif normalization == "LayerNorm":
        y = F.layer_norm(x32, x.shape[-1:], eps=eps)
    else:
        raise ValueError(f"Unsupported normalization type {normalization!r}; valid: "
                         f"{', '.join(NORMALIZATIONS)}")
    gamma = weight.to(x32.dtype) + 1.0 if zero_centered_gamma else weight.to(x32.dtype)
    y = y * gamma
    if bias is not None:
        y = y + bias.to(x32.dtype)
    return y.to(x.dtype)
