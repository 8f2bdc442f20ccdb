"""Quantization error of a GEMM operand, E = Q(T) - T, for a candidate precision and role.

The collector calls an `ErrorFn(tensor_2d, precision, role) -> error tensor` on operands in their
natural 2D layout (X: n x k, W: m x k, G_Y: n x m; `Role.contraction_dim` says which dim a GEMM
contracts), with `group`, the TP group of a sharded operand, and `shard`, (rank, world, partition
stride) of a G_Y whose columns are TP-sharded. The default quantizes with `snip_megatron.formats`
(the same fake quantizers the emulated linears use); tests and benchmarks may pass their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from snip_megatron.formats.precision import Formats, Precision

ErrorFn = Callable[..., torch.Tensor]  # (tensor_2d, precision, role, group=None, shard=(0, 1, 1)) -> error

# Stats field of each role's squared error (table.ERROR_ROLES), by formats.Role value.
ROLE_FIELDS = {
    "fprop_input": "ex",
    "fprop_weight": "ew",
    "dgrad_grad_output": "egy_d",
    "dgrad_weight": "ew_d",
    "wgrad_grad_output": "egy_w",
    "wgrad_input": "ex_w",
}


def _layout_free(cast) -> bool:
    """A cast that quantizes a tensor the same whichever dim is contracted: square (or per-tensor)
    blocks, round-to-nearest, no Hadamard. A weight cast like this serves fprop and dgrad alike
    (TE quantizes such a weight once for both GEMMs)."""
    from snip_megatron.formats.spec import Rounding

    return (cast is not None and cast.rounding is Rounding.NEAREST_EVEN and not cast.hadamard
            and (cast.block is None or cast.block[0] == cast.block[1]))


def formats_error_fn(formats: Formats = Formats(), seed: int = 0) -> ErrorFn:
    """E = Q(T) - T with the project's fake quantizers; stochastic rounding draws from a dedicated
    generator on the tensor's device (seeded once per device), never from the global RNG, the
    whole tensor's noise at a shard's columns (so TP=N measures as TP=1). The error of the last
    tensor under a layout-free cast is kept, so a weight's dgrad error is not recomputed when it
    equals fprop's."""
    from snip_megatron.formats.quantize import quantize_for_role as quantize
    from snip_megatron.formats.spec import Role, Rounding
    from snip_megatron.formats.sr_noise import draw_seed, shard_noise

    specs = {p: formats.spec(p) for p in (Precision.FP8, Precision.FP4)}
    generators: dict = {}  # one per device: stochastic rounding draws where the tensor is (no host copy)
    last: list = []  # [tensor, version, cast, group, error]: the tensor is held, so `is` is safe

    def error(t: torch.Tensor, precision: Precision, role: str, group=None, shard=(0, 1, 1)) -> torch.Tensor:
        # group: the TP group of a sharded operand, so per-tensor scales see the whole tensor
        spec, role = specs[Precision.parse(precision)], Role(role)
        cast = spec.cast(role)
        reuse = _layout_free(cast)
        if reuse and last and last[0] is t and last[1] == t._version and last[2] == cast and last[3] is group:
            return last[4]
        tf = t.float()
        generator = generators.get(tf.device)
        if generator is None:
            generator = generators[tf.device] = torch.Generator(device=tf.device).manual_seed(seed)
        noise = None
        if cast is not None and cast.rounding is Rounding.STOCHASTIC:
            rank, world, stride = shard
            noise = shard_noise(draw_seed(generator), tf.shape, rank=rank, world=world, stride=stride,
                                device=tf.device)
        e = quantize(tf, spec, role, out_dtype=torch.float32, noise=noise, amax_group=group) - tf
        last[:] = [t, t._version, cast, group, e] if reuse else []
        return e

    return error


def blockwise_error_fn(block: dict | None = None, mantissa_bits: dict | None = None) -> ErrorFn:
    """A simple, exact-to-reason-about stand-in quantizer for tests: per block of `block[p]`
    elements along the contraction dim, scale by the block amax and round to `mantissa_bits[p]`
    bits of a fixed-point grid. Deterministic and shard-local like real block formats."""
    block = block or {Precision.FP8: 16, Precision.FP4: 16}
    bits = mantissa_bits or {Precision.FP8: 6, Precision.FP4: 2}

    def error(t: torch.Tensor, precision: Precision, role: str, group=None, shard=(0, 1, 1)) -> torch.Tensor:
        p = Precision.parse(precision)
        t = t.float()
        contract_last = role in ("fprop_input", "fprop_weight", "dgrad_grad_output")
        x = t if contract_last else t.t()
        b = block[p]
        rows, cols = x.shape
        if cols % b:
            raise ValueError(f"blockwise_error_fn: dim {cols} is not a multiple of block {b}")
        xb = x.reshape(rows, cols // b, b)
        amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        step = amax / 2 ** bits[p]
        q = (torch.round(xb / step) * step).reshape(rows, cols)
        e = q - x
        return e if contract_last else e.t()

    return error
