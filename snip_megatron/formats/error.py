"""||Q(T) - T||^2 of a captured tensor for a candidate precision and GEMM role (for statistics)."""

from __future__ import annotations

import torch

from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.formats.quantize import quantize_for_role
from snip_megatron.formats.spec import Role, Rounding


@torch.no_grad()
def quantization_error(tensor: torch.Tensor, precision: "Precision | str", role: "Role | str", *,
                       formats: Formats = Formats(), seed: int = 0,
                       amax_group=None) -> torch.Tensor:
    """Squared Frobenius norm of Q(T) - T as a float32 scalar tensor (0 for BF16).

    tensor: the role's operand in its natural layout (X: [..., k], W: m x k, G_Y: [..., m]).
    seed: seeds a private generator for roles with stochastic rounding, so the value is
        reproducible and the training RNG streams are untouched.
    amax_group: TP group of a sharded operand (per-tensor scales see the whole tensor); the result
        is this shard's share, sum it over the group for the whole tensor.
    With a Hadamard transform the error is measured in the transformed domain, which has the same
    norm (the transform is orthogonal).
    """
    spec = formats.spec(precision)
    cast = spec.cast(Role(role))
    if cast is None:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    generator = None
    if cast.rounding is Rounding.STOCHASTIC:
        generator = torch.Generator(device=tensor.device).manual_seed(seed)
    q = quantize_for_role(tensor, spec, role, out_dtype=torch.float32, generator=generator,
                          amax_group=amax_group)
    return (q - tensor.float()).square().sum()
