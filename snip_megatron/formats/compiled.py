"""The block cast as one compiled graph (torch.compile): the fused path's arithmetic, written
without its scratch buffers and chunks, so that Inductor can emit it as a few kernels on a GPU
(per-tensor amax, block amax, scales, rounding and decode) instead of some twenty eager launches.

Opt-in (`SNIP_COMPILED_CAST=1`) and checked: Inductor's GPU code is not bit-for-bit the eager
ops by default (Triton lowers float32 `/` to the approximate `div.full`; Inductor's
`eager_numerics.division_rounding` asks for `div_rn`, set here while compiling), and no GPU has
run it in this project yet. So the first call of every (cast, dtypes, noise) key also runs the
eager fused path and compares every bit of the result (NaN where NaN); on any difference, or if
compiling fails, that key runs the eager path from then on, and says so once. What SNIP measures
stays what the eager reference computes. `bench/gpu/compiled_cast_check.py` prints this path's
agreement, compile time and speed on a GPU.

Served: blocked and per-tensor casts without codes, the amax local to the tensor (no all-reduce
in the middle), round-to-nearest or stochastic rounding with a noise tensor. The rest (codes,
amax groups of several ranks) runs the eager fused path.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from snip_megatron.formats.elements import GRID
from snip_megatron.formats.scales import block_scales, group_size, per_tensor_scales
from snip_megatron.formats.spec import CastConfig, ElementFormat

_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
_COMPILED: dict = {}
_VERDICT: dict = {}  # key -> True (compiled path agrees) / False (eager from now on)


def enabled() -> bool:
    return os.environ.get("SNIP_COMPILED_CAST", "0") in ("1", "true", "yes")


def serves(x: torch.Tensor, want_codes: bool, amax_group) -> bool:
    """Whether this cast can go through the compiled graph (opt-in, off CPU, no codes, local amax)."""
    return (enabled() and x.device.type != "cpu" and not want_codes
            and (amax_group is None or group_size(amax_group) == 1))


def cast_2d(x, cast: CastConfig, block, u, out_dtype, eager):
    """The dequantized cast of a 2D tensor of whole blocks (the fused path's `_quantize_2d`
    without codes), through the compiled graph once its first call agreed bit for bit with
    `eager()` (the fused path's result); else `eager()`."""
    key = (cast, block, x.dtype, out_dtype, u is not None, x.device.type)
    verdict = _VERDICT.get(key)
    if verdict is False:
        return eager()
    try:
        out = _compiled(key)(x, u, cast, block, out_dtype)
    except Exception as e:  # a compile or codegen failure: the eager path is always there
        _VERDICT[key] = False
        _LOG.warning("snip: compiled cast of %s failed (%s: %s); the eager fused path runs it",
                     _describe(key), type(e).__name__, e)
        return eager()
    if verdict is None:
        ref = eager()
        agree = same_bits(out, ref)
        _VERDICT[key] = agree
        if not agree:
            _LOG.warning("snip: compiled cast of %s differs from the eager path; the eager fused "
                         "path runs it", _describe(key))
            return ref
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits, NaN wherever the other has NaN (a NaN's payload aside)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a32, b32 = a.float(), b.float()
    nan = torch.isnan(a32)
    if not torch.equal(nan, torch.isnan(b32)):
        return False
    zero = torch.zeros((), dtype=a32.dtype, device=a32.device)
    return torch.equal(torch.where(nan, zero, a32).view(torch.int32),
                       torch.where(nan, zero, b32).view(torch.int32))


def reset() -> None:
    """Forget the compiled graphs and verdicts (tests)."""
    _COMPILED.clear()
    _VERDICT.clear()


def _describe(key) -> str:
    cast, block, dtype, out_dtype, noise, device = key
    return (f"{cast.element.value}/{cast.scale.value} block {block} {dtype}->{out_dtype}"
            f"{' with noise' if noise else ''} on {device}")


def _compiled(key):
    fn = _COMPILED.get(key)
    if fn is None:
        with _LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                fn = _COMPILED[key] = _compile()
    return fn


def _compile():
    """A compiled `_cast_graph` for one key, shapes dynamic (a new token count does not recompile).
    Division as eager rounds it (Triton's div_rn) is a compile option, so calls pay no config
    patch. Every key's graphs are cached on `_cast_graph`'s one code object, so dynamo's recompile
    limit (8 by default) would send the ninth key to uncompiled ops: it is raised once, when the
    opted-in path compiles its first graph."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 256)
    options = {}
    if hasattr(inductor_config, "eager_numerics"):  # torch >= 2.10
        options["eager_numerics.division_rounding"] = True
    return torch.compile(_cast_graph, dynamic=True, options=options)


def _cast_graph(x, u, cast: CastConfig, block, out_dtype):
    """The fused path's cast (fused._quantize_2d without codes, one chunk), as pure tensor ops."""
    xf = x.float()
    rows, cols = xf.shape
    br, bc = block if block is not None else (1, cols)
    per_tensor = None
    if block is None or cast.tensor_scale:
        amax = (xf.view(torch.int32) & 0x7FFFFFFF).amax().view(torch.float32)
        per_tensor = per_tensor_scales(amax, cast, block)
    if block is None:
        enc, decode = per_tensor
        shape = (rows, cols)
    else:
        shape = (rows // br, br, cols // bc, bc)
        bits = (xf.view(torch.int32) & 0x7FFFFFFF).view(shape).amax(dim=(1, 3))
        enc, decode, _ = block_scales(bits.view(torch.float32), cast, per_tensor)
        enc, decode = (s.view(shape[0], 1, shape[2], 1) for s in (enc, decode))
    y = xf.view(shape) * enc
    q = _round(y, cast.element, None if u is None else u.view(shape), GRID[cast.element])
    return (q * decode).view(rows, cols).to(out_dtype)


def _round(y, element: ElementFormat, u, grid):
    """fused._round_in_place as pure ops: y on the element grid, saturated, sign kept. (Traced
    as written there, with its scratch buffers and out= ops, the graphs take about 7x longer to
    compile.)"""
    top, min_exp_bits, magic_shift = grid
    yi = y.view(torch.int32)
    sign = yi & -(1 << 31)
    a = (yi ^ sign).view(torch.float32).clamp(max=top)
    exp = torch.clamp((a.view(torch.int32) & 0x7F800000), min=min_exp_bits)
    if u is None:
        magic = (exp + magic_shift).view(torch.float32)
        a = (a + magic) - magic
    else:
        step = (exp - (1 << 23)).view(torch.float32)
        a = (torch.floor(a / step + u) * step).clamp(max=top)
    return (a.view(torch.int32) | sign).view(torch.float32)
