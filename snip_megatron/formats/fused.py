"""The fast fake quantizer: the casts of `quantize_reference`, bit for bit, in fewer passes.

Where the reference's time goes (CPU, eager): a full-size temporary per step, each a fresh
allocation whose first touch (page faults) costs more than its arithmetic; a reduction over the
16 or 32 innermost elements of each block that does not vectorize; float8 casts that convert
element by element (float8 -> float32 about 6 ns an element); a transposing copy in and out for
the roles blocked along the token dim. This path is written in the same eager ops (any device,
nothing to compile), and:

- works in the operand's own layout: a block along dim 0 is a (b x 1) tile there, so no
  transposing copy is made; only the roles with a Hadamard transform go through the GEMM layout,
  where the transform is the reference's own (hadamard.py, so its rounding is the reference's);
- reads block amaxes from the integer bits: |x| is x's bits with the sign cleared, and their
  integer order is the float order (NaN above Inf above every finite value);
- rounds to the element grid with float adds of a magic power of two and integer masks, in
  place, for E2M1 and for E4M3/E5M2 alike (exactly the round-to-nearest-even of torch's float8
  casts, without them);
- computes the scales with the reference's formulas, operation for operation (scales.py);
- on CPU, walks the tensor in row chunks of about `CHUNK_ELEMENTS` (block amax, scales, cast and
  decode per chunk), so intermediates stay in cache and three scratch buffers serve every chunk.
  Only the result (and, with return_codes, the codes) is allocated at full size. A per-tensor
  scale (NVFP4's, tensorwise FP8's) costs one read pass before.

On CPU with the compiled kernel (formats/cpu_kernel.py) each cast is one kernel call instead
(formats/kernel_path.py): per-tensor amax, block scales, rounding with counter-based
stochastic-rounding noise drawn in registers (formats/sr_noise.py) and, for the Hadamard roles,
the transform and its inverse. A cast as a GEMM operand (`operand=True`, formats/operand.py)
runs the eager path.

Contract (tests/formats/test_fused.py): the dequantized values equal the reference's bit for bit
(NaN where the reference has NaN); codes and scales too, except inside a scaling group that holds
a NaN, whose codes and FP32/E4M3 scales the reference leaves to the platform's NaN signs (its
dequantized values are NaN in both, its E8M0 scale is 255 in both).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from snip_megatron.formats import compiled, kernel_path
from snip_megatron.formats.cpu_kernel import use_cpu_kernel
from snip_megatron.formats.elements import GRID, e2m1_codes, fp8_dtype
from snip_megatron.formats.hadamard import hadamard_last_dim
from snip_megatron.formats.quantized import QuantizedTensor
from snip_megatron.formats.scales import block_scales, per_tensor_scales, reduce_amax
from snip_megatron.formats.spec import CastConfig, ElementFormat, Rounding, ScaleFormat
from snip_megatron.formats.sr_noise import CounterNoise, KernelNoise, stochastic_noise

CHUNK_ELEMENTS = 1 << 18
"""Elements per row chunk on CPU (1 MiB of float32 per buffer: a chunk's buffers stay in cache).
A chunk holds a whole number of block rows. Measured on 2 AVX2 cores: 2**16 costs more in
per-op overhead, 2**20 more in cache misses (bench/quantize_throughput.py)."""

_SIGN = -(1 << 31)  # 0x80000000 as int32
_ABS = 0x7FFFFFFF  # clears the sign bit
_EXP = 0x7F800000  # the exponent field


@torch.no_grad()
def quantize_fused(tensor: torch.Tensor, cast: CastConfig, *, dim: int = -1,
                   out_dtype: torch.dtype | None = None, noise: torch.Tensor | None = None,
                   generator: torch.Generator | None = None, amax_group=None,
                   return_codes: bool = False, operand: bool = False):
    """`quantize_reference(...)`, bit for bit (see the module docstring), fast. `cast` is not None
    and `tensor` was checked by `quantize`. operand=True: the cast as a GEMM reads it
    (`formats/operand.py`), a tuple (values in the GEMM layout, tensor scale, block scales,
    block)."""
    out_dtype = tensor.dtype if out_dtype is None else out_dtype
    if dim not in (0, -1, tensor.dim() - 1):
        raise ValueError(f"quantize: dim must be 0 or -1 (the blocked dimension), got {dim}")
    transposed = dim == 0 and tensor.dim() > 1
    x2 = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() != 1 else tensor.reshape(1, -1)
    # The CPU kernel writes dequantized values only; operands take the eager path.
    kernel = tensor.device.type == "cpu" and not operand and use_cpu_kernel()
    # Stochastic-rounding noise: a tensor in x2's layout, or (CPU kernel) the counter-based
    # generator's parameters, which the kernel draws from in registers.
    u = None
    if cast.rounding is Rounding.STOCHASTIC:
        u = stochastic_noise(noise, generator, tensor)
        if not (isinstance(u, CounterNoise) and kernel):
            if isinstance(u, CounterNoise):
                u = u.uniform(tensor.shape, tensor.device)
            u = u.float().reshape(x2.shape)

    if cast.hadamard and kernel and kernel_path.hadamard_kernel_serves(tensor, cast, u, amax_group):
        return kernel_path.quantize_hadamard_kernel(x2, tensor, cast, transposed, u, out_dtype, return_codes)
    if cast.hadamard:
        # The reference's layout and transform; the quantization in between is this module's.
        xg = _float_copy(x2.t() if transposed else x2)
        if isinstance(u, CounterNoise):
            u = KernelNoise(u, transposed, *x2.shape)
        elif u is not None and transposed:
            u = _float_copy(u.t())
        rows, cols = xg.shape
        pads = (-rows % cast.block[0], -cols % cast.block[1])
        if any(pads):
            xg = F.pad(xg, (0, pads[1], 0, pads[0]))
            u = u if u is None or isinstance(u, KernelNoise) else F.pad(u, (0, pads[1], 0, pads[0]))
        xg = hadamard_last_dim(xg, cast.hadamard)
        if operand:  # the GEMM contracts in the transformed domain, padding included (zeros before)
            values, _, scales, tensor_scale = _quantize_2d(xg, cast, cast.block, u, torch.bfloat16,
                                                           amax_group, False, kernel, factor=True)
            return values, tensor_scale, scales, cast.block
        deq, codes, scales, tensor_scale = _quantize_2d(xg, cast, cast.block, u, torch.float32,
                                                       amax_group, return_codes, kernel)
        deq = hadamard_last_dim(deq, cast.hadamard, inverse=True)[:rows, :cols]
        deq = (deq.t() if transposed else deq).reshape(tensor.shape).to(out_dtype)
        return QuantizedTensor(deq, codes, scales, tensor_scale) if return_codes else deq

    rows, cols = x2.shape
    if isinstance(u, CounterNoise):
        u = KernelNoise(u, False, rows, cols)
    block = None
    pads = (0, 0)
    if cast.block is not None:
        block = (cast.block[1], cast.block[0]) if transposed else cast.block  # in x2's layout
        pads = (-rows % block[0], -cols % block[1])
    if any(pads):
        x2 = F.pad(x2, (0, pads[1], 0, pads[0]))
        u = u if u is None or isinstance(u, KernelNoise) else F.pad(u, (0, pads[1], 0, pads[0]))
    if operand:
        values, _, scales, tensor_scale = _quantize_2d(x2, cast, block, u, torch.bfloat16, amax_group,
                                                       False, kernel, factor=True)
        values = values[:rows, :cols]
        if transposed:  # the GEMM layout: blocked (contracted) dim last
            values, scales = values.t(), (None if scales is None else scales.t())
        return values, tensor_scale, scales, cast.block
    deq, codes, scales, tensor_scale = _quantize_2d(
        x2, cast, block, u, torch.float32 if any(pads) else out_dtype, amax_group, return_codes, kernel)
    deq = deq[:rows, :cols].reshape(tensor.shape).to(out_dtype)
    if not return_codes:
        return deq
    if transposed:  # codes and scales in the GEMM layout (blocked dim last), as the reference
        codes, scales = codes.t().contiguous(), scales.t().contiguous()
    return QuantizedTensor(deq, codes, scales, tensor_scale)


def _float_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy of x (one pass, converting and transposing at once)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return out.copy_(x)


def _quantize_2d(x, cast: CastConfig, block, u, out_dtype, amax_group, want_codes, kernel: bool,
                 factor: bool = False):
    """Q of a 2D tensor whose dims are whole blocks of `block` (rows, cols, in x's own layout), or
    per-tensor (block None): (dequantized, codes, scales, tensor scale); codes and scales are None
    unless want_codes. `kernel`: the CPU kernel runs it. `factor`: see `_quantize_2d_eager`."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()  # float64: rounded to float32 first, as the reference
    x = x.contiguous()
    if kernel:
        return kernel_path.quantize_2d_kernel(x, cast, block, u, out_dtype, amax_group, want_codes)
    if not factor and compiled.serves(x, want_codes, amax_group):
        out = compiled.cast_2d(x, cast, block, u, out_dtype, lambda: _quantize_2d_eager(
            x, cast, block, u, out_dtype, amax_group, False)[0])
        return out, None, None, None
    return _quantize_2d_eager(x, cast, block, u, out_dtype, amax_group, want_codes, factor)


def _quantize_2d_eager(x, cast: CastConfig, block, u, out_dtype, amax_group, want_codes,
                       factor: bool = False):
    """`_quantize_2d` in eager ops, a chunk of rows at a time (x float32/bfloat16/float16,
    contiguous). factor=True: the values keep only the scales BF16 holds exactly with an element
    (`_operand_decode`); returns (values, None, FP32 block scales or None, tensor scale or None)."""
    rows, cols = x.shape
    br, bc = block if block is not None else (1, cols)
    c = _constants(x.device)
    step = _chunk_rows(x, br)
    scratch = _scratch(min(rows, step) * cols, x.device)

    # Per-tensor scales first (one read pass): tensorwise FP8, NVFP4's second level.
    per_tensor = None
    if block is None or cast.tensor_scale:
        per_tensor = per_tensor_scales(reduce_amax(_abs_max(x, step, scratch, c), amax_group),
                                       cast, block)

    out = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    q_all = torch.empty((rows, cols), dtype=torch.float32, device=x.device) if want_codes else None
    scales_all = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = (r1 - r0) * cols
        y = scratch.y[:n] if q_all is None else q_all[r0:r1].view(-1)
        xc = x[r0:r1]
        if x.dtype != torch.float32:  # widen into the buffer once; the rest runs on float32
            xc = y.view(xc.shape).copy_(xc)
        if block is None:
            enc, decode = per_tensor
            shape = (r1 - r0, cols)
        else:
            shape = ((r1 - r0) // br, br, cols // bc, bc)
            block_amax = _block_amax(xc, br, bc, scratch, c)
            enc, decode, scales = block_scales(block_amax, cast, per_tensor)
            enc, decode = (s.view(shape[0], 1, shape[2], 1) for s in (enc, decode))
            if want_codes:
                scales_all.append(scales)
        if factor:
            decode, k_scales = _operand_decode(decode, cast, scales if block is not None else None)
            if k_scales is not None:
                scales_all.append(k_scales.reshape(-1))
        y = y.view(shape)
        torch.mul(xc.view(shape), enc, out=y)  # in place when xc is the buffer
        _round_in_place(y.view(-1), cast.element, None if u is None else u[r0:r1], scratch, c)
        torch.mul(y, decode, out=out[r0:r1].view(shape))

    if factor:
        k_scales = torch.cat(scales_all).reshape(rows // br, cols // bc) if scales_all else None
        return out, None, k_scales, None if per_tensor is None else per_tensor[1].reshape(())
    if not want_codes:
        return out, None, None, None
    if block is None:
        scales, tensor_scale = per_tensor[1].reshape(1, 1), None
    else:
        scales = torch.cat(scales_all).reshape(rows // br, cols // bc)
        tensor_scale = per_tensor[1] if cast.tensor_scale else None
    if cast.element is ElementFormat.E2M1:
        codes = e2m1_codes(q_all)
    else:
        codes = q_all.to(fp8_dtype(cast.element))  # exact: q_all is on the grid
    return out, codes, scales, tensor_scale


def _operand_decode(decode, cast: CastConfig, block_scales):
    """(the decode scale a GEMM operand keeps, the FP32 block scale the GEMM applies or None).
    An element times a power of two (E8M0, pow2) or times an E4M3 block scale (NVFP4: at most
    2 + 4 significant bits) is exact in BF16 and stays; an FP32 scale goes to the GEMM (the
    per-tensor one: the caller returns it; a block one: returned here). NaN (a group that is not
    finite) stays in the operand."""
    nan = torch.isnan(decode)
    if cast.block is None or cast.scale is ScaleFormat.FP32:
        kept = torch.where(nan, decode, torch.ones_like(decode))
        return kept, (None if cast.block is None else decode)
    if cast.tensor_scale:
        return torch.where(nan, decode, block_scales.float().view(decode.shape)), None
    return decode, None


def _chunk_rows(x, br: int) -> int:
    """Rows per chunk: a multiple of br; the whole tensor off CPU (kernel launches, not cache
    misses, bound a GPU)."""
    if x.device.type != "cpu":
        return max(br, x.shape[0])
    rows = max(1, CHUNK_ELEMENTS // max(1, x.shape[1]))
    return max(br, rows // br * br)


class _Scratch:
    """The buffers every chunk reuses: y (float32, the chunk widened, then scaled and rounded),
    and two int32 ones (|x|'s bits for the amaxes, then the sign bits and the magic numbers)."""

    def __init__(self, n: int, device):
        self.n = n
        self.y = torch.empty(n, dtype=torch.float32, device=device)
        self.sign = torch.empty(n, dtype=torch.int32, device=device)
        self.magic = torch.empty(n, dtype=torch.int32, device=device)


_KEPT = threading.local()


def _scratch(n: int, device) -> _Scratch:
    """Scratch of at least n elements. On CPU, kept per thread and reused across calls (freshly
    allocated buffers cost their page faults at every call, more than the arithmetic in them);
    elsewhere allocated per call (the caching allocator reuses them)."""
    if device.type != "cpu" or n > 4 * CHUNK_ELEMENTS:
        return _Scratch(n, device)
    kept = getattr(_KEPT, "scratch", None)
    if kept is None or kept.n < n:
        kept = _KEPT.scratch = _Scratch(max(n, CHUNK_ELEMENTS), device)
    return kept


def reserve_cpu_scratch() -> None:
    """Allocate this thread's CPU scratch at its largest size now, so that no later call grows it
    (memory accounting that should see what a GPU allocates: bench/measure_scale.py)."""
    _scratch(4 * CHUNK_ELEMENTS, torch.device("cpu"))


def _round_in_place(y, element: ElementFormat, u, scratch: _Scratch, c: dict) -> None:
    """y (flat float32) -> its values on the element grid, saturated, sign kept (-0 stays -0,
    NaN stays NaN): nearest-even, or stochastic with noise u (y's rows, x's layout)."""
    top, min_exp_bits, magic_shift = GRID[element]
    n = y.numel()
    yi = y.view(torch.int32)
    sign, magic = scratch.sign[:n], scratch.magic[:n]
    torch.bitwise_and(yi, c["sign"], out=sign)
    yi.bitwise_xor_(sign)  # |y|
    y.clamp_(max=top)  # saturate; NaN stays NaN
    torch.bitwise_and(yi, c["exp"], out=magic)
    torch.maximum(magic, c[min_exp_bits], out=magic)
    magic_f = magic.view(torch.float32)
    if u is None:
        magic.add_(c[magic_shift])
        y.add_(magic_f).sub_(magic_f)
    else:  # E2M1 only (CastConfig): floor(|y| / step + u) * step, step half the power of two
        magic.sub_(c["one_exp"])
        y.div_(magic_f).add_(u.reshape(-1))  # exact division by a power of two, as the reference
        y.floor_().mul_(magic_f).clamp_(max=top)  # 3 + u may round up to 4: keep 6 the top
    yi.bitwise_or_(sign)


_CONSTANTS: dict = {}


def _constants(device) -> dict:
    """0-dim integer tensors of the bit patterns, per device (a Python int operand of an integer
    op is converted on every call)."""
    table = _CONSTANTS.get(device)
    if table is None:
        values = {"sign": _SIGN, "abs": _ABS, "exp": _EXP, "one_exp": 1 << 23}
        for _, bits, shift in GRID.values():
            values[bits], values[shift] = bits, shift
        table = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in values.items()}
        table["abs16"] = torch.tensor(0x7FFF, dtype=torch.int16, device=device)
        _CONSTANTS[device] = table
    return table


def _abs_bits(x, scratch: _Scratch, c: dict):
    """|x|'s bits (float32 x) as int32, in a scratch buffer of x's shape."""
    buf = scratch.magic[:x.numel()].view(x.shape)
    return torch.bitwise_and(x.view(torch.int32), c["abs"], out=buf)


def _abs_max(x, step: int, scratch: _Scratch, c: dict) -> torch.Tensor:
    """max |x| as a float32 0-dim tensor (NaN if x holds one), `step` rows at a time."""
    best = None
    for r0 in range(0, x.shape[0], step):
        xc = x[r0:r0 + step]
        if xc.dtype != torch.float32:
            xc = scratch.y[:xc.numel()].view(xc.shape).copy_(xc)
        m = _abs_bits(xc, scratch, c).max()
        best = m if best is None else torch.maximum(best, m)
    return best.view(torch.float32)


def _block_amax(x, br: int, bc: int, scratch: _Scratch, c: dict) -> torch.Tensor:
    """max |x| per (br x bc) block of a float32 chunk, (rows // br, cols // bc); NaN where a block
    holds one."""
    rows, cols = x.shape
    a = _abs_bits(x, scratch, c)
    if br == bc == 1:
        return a.view(torch.float32).clone()  # not the scratch buffer itself
    if br > 1:
        a = a.view(rows // br, br, cols).amax(1)  # over rows: vectorized along the columns
    if bc > 1:
        # Over the outer dim of the transposed view: vectorized; over 16 contiguous elements the
        # reduction is not.
        a = torch.amax(a.reshape(-1, bc).t(), 0)
    return a.view(rows // br, cols // bc).view(torch.float32)
