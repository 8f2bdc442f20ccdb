"""The CPU kernel's casts (formats/cpu_kernel.py, csrc/quantize_cpu.cpp): each cast of the fused
path in one kernel call, bit for bit the same (tests/formats/test_fused.py).

`fused.quantize_fused` sends CPU tensors here where `cpu_kernel.use_cpu_kernel()` says the kernel is
built and switched on; the eager path in fused.py runs everything else.
"""

from __future__ import annotations

import torch

from snip_megatron.formats.cpu_kernel import kernel, use_cpu_kernel
from snip_megatron.formats.elements import e2m1_codes, fp8_dtype
from snip_megatron.formats.hadamard import hadamard_factor, hadamard_signs
from snip_megatron.formats.quantized import QuantizedTensor
from snip_megatron.formats.scales import group_size, per_tensor_scales, reduce_amax
from snip_megatron.formats.spec import CastConfig, ElementFormat, ScaleFormat
from snip_megatron.formats.sr_noise import CounterNoise, KernelNoise

ELEMENT_CODES = {ElementFormat.E2M1: 0, ElementFormat.E4M3: 1, ElementFormat.E5M2: 2}
SCALE_CODES = {ScaleFormat.FP32: 1, ScaleFormat.POW2: 2, ScaleFormat.E8M0: 3}  # else NVFP4: 4

def quantize_2d_kernel(x, cast: CastConfig, block, u, out_dtype, amax_group, want_codes):
    """`fused._quantize_2d` on CPU by the compiled kernel: one call. The kernel computes the per-tensor
    scales from its own amax pass (with the reference's formulas, as the 0-dim torch ops here
    compute them) unless the amax is all-reduced over a group of more than one rank; then here.
    It computes the block scales with the same formulas and rounds as `fused._round_in_place`, drawing
    counter-based noise itself (`KernelNoise`)."""
    k = kernel()
    if x.dtype == torch.float16:
        x = x.float()
    rows, cols = x.shape
    enc = dec = global_scale = inv_global = 1.0
    tensor_finite = True
    per_tensor_scale = None
    per_tensor = block is None or cast.tensor_scale
    amax_in_kernel = per_tensor and (amax_group is None or group_size(amax_group) == 1)
    if per_tensor and not amax_in_kernel:
        amax = reduce_amax(k.abs_max(x), amax_group)
        tensor_finite = bool(torch.isfinite(amax))
        if block is None:
            enc_t, dec_t = per_tensor_scales(amax, cast, block)
            enc, dec, per_tensor_scale = float(enc_t), float(dec_t), dec_t
        else:
            _, g, inv_g = per_tensor_scales(amax, cast, block)
            global_scale, inv_global, per_tensor_scale = float(g), float(inv_g), g
    kernel_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty((rows, cols), dtype=kernel_dtype)
    q = torch.empty((rows, cols), dtype=torch.float32) if want_codes else None
    if block is None:
        br, bc, scale_code, scales = 1, cols, 0, None
    else:
        br, bc = block
        scale_code = SCALE_CODES.get(cast.scale, 4)
        scale_dtype = torch.float32 if scale_code in (1, 2) else torch.uint8
        scales = torch.empty((rows // br, cols // bc), dtype=scale_dtype)
    noise_args = {}
    if isinstance(u, KernelNoise):
        seed, col_offset = u.noise
        noise_args = dict(noise_counter=True, seed_lo=seed & 0xFFFFFFFF,
                          seed_hi=(seed >> 32) & 0xFFFFFFFF, col_offset=col_offset,
                          noise_transposed=u.transposed, nat_rows=u.rows, nat_cols=u.cols)
        u = None
    kernel_scale = k.quantize_blocks(
        x, out, q, None if u is None else u.float().contiguous(), scales, br, bc,
        ELEMENT_CODES[cast.element], scale_code, cast.element.max, enc, dec, global_scale,
        inv_global, tensor_finite, tensor_amax=amax_in_kernel, **noise_args)
    out = out if out.dtype == out_dtype else out.to(out_dtype)
    if not want_codes:
        return out, None, None, None
    if amax_in_kernel:
        per_tensor_scale = torch.tensor(kernel_scale, dtype=torch.float32)
        per_tensor_scale = per_tensor_scale.reshape(1, 1) if block is None else per_tensor_scale
    tensor_scale = None
    if block is None:
        scales = per_tensor_scale
    elif scale_code == 4:
        scales, tensor_scale = scales.view(torch.float8_e4m3fn), per_tensor_scale
    if cast.element is ElementFormat.E2M1:
        codes = e2m1_codes(q)
    else:
        codes = q.to(fp8_dtype(cast.element))  # exact: q is on the grid
    return out, codes, scales, tensor_scale


def hadamard_kernel_serves(tensor, cast: CastConfig, u, amax_group) -> bool:
    """Whether the kernel's one-call Hadamard path (`quantize_hadamard`) takes this cast: CPU,
    NVFP4's shape of it (16-point transform, 1 x 16 blocks), no noise or counter-based noise,
    and no amax group to all-reduce the per-tensor amax over."""
    return (tensor.device.type == "cpu" and cast.hadamard == 16 and cast.block == (1, 16)
            and (u is None or isinstance(u, CounterNoise))
            and (amax_group is None or group_size(amax_group) == 1) and use_cpu_kernel())


_HADAMARD_SIGNS: dict = {}


def quantize_hadamard_kernel(x2, tensor, cast: CastConfig, transposed: bool, noise, out_dtype,
                              want_codes):
    """M^T Q(M x) by the kernel in one call: it reads the operand in its own layout, transforms
    16-element chunks of the GEMM layout (hadamard.py's order), takes the per-tensor amax of the
    transformed tensor (a first pass, transforming again), quantizes, transforms back and writes
    the result in the GEMM layout; returned as its transposed view where the blocks run along
    dim 0, as the other path."""
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()  # float64 rounded to float32 first, as the reference
    x2 = x2.contiguous()
    g_rows, g_cols = (x2.shape[1], x2.shape[0]) if transposed else x2.shape
    g_pad = g_cols + (-g_cols % 16)
    out = torch.empty((g_rows, g_cols), dtype=torch.float32)
    q = torch.empty((g_rows, g_pad), dtype=torch.float32) if want_codes else None
    scale_code = SCALE_CODES.get(cast.scale, 4)
    scales = torch.empty((g_rows, g_pad // 16),
                         dtype=torch.float32 if scale_code in (1, 2) else torch.uint8)
    if cast.hadamard not in _HADAMARD_SIGNS:
        _HADAMARD_SIGNS[cast.hadamard] = hadamard_signs(cast.hadamard).float()
    seed, col_offset = noise if noise is not None else (0, 0)
    global_scale = kernel().quantize_hadamard(
        x2, out, q, scales, _HADAMARD_SIGNS[cast.hadamard], hadamard_factor(cast.hadamard),
        transposed, ELEMENT_CODES[cast.element], scale_code, cast.element.max,
        noise is not None, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, col_offset)
    deq = (out.t() if transposed else out).reshape(tensor.shape).to(out_dtype)
    if not want_codes:
        return deq
    tensor_scale = None
    if scale_code == 4:
        scales, tensor_scale = scales.view(torch.float8_e4m3fn), torch.tensor(global_scale)
    if cast.element is ElementFormat.E2M1:
        codes = e2m1_codes(q)
    else:
        codes = q.to(fp8_dtype(cast.element))  # exact: q is on the grid
    return QuantizedTensor(deq, codes, scales, tensor_scale)
