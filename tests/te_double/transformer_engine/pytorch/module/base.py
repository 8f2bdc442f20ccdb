"""Test double of `transformer_engine.pytorch.module.base` (TE 2.14): the state every TE module
keeps about the quantization it runs, and the GEMMs the linears share.

Per forward (`_quantization_for_forward`, after TE's `init_fp8_metadata` / `set_meta_tensor`):
- outside an enabled autocast the GEMMs are plain (`fp8_initialized` drops back to False);
- inside, the module takes the autocast's recipe and group into `fp8_meta`; a recipe equal to the
  one it already holds changes nothing; a new recipe of the same family keeps the quantizers it
  has (see `_formats.quantizer_recipe`); a change of class warns "Recipe type changed ..." and
  clears the module's weight workspaces (base.py:1060-1070); a high-precision forward in between
  clears nothing (init_fp8_metadata returns early, base.py:1034-1037);
- a CustomRecipe gets its quantizers from `qfactory(role)` whenever it is (re)initialised, one call
  per te.Linear role (TE's CustomRecipeState protocol), kept in `quantizers`;
- TE's kernel checks on the double's GPU capability (`_formats.check_kernels`) raise RuntimeError,
  then the shape and bias checks of `_forward_checks` (ValueError / RuntimeError as TE raises);
- the GEMMs run the recipe's quantizers (`_formats.quantizers_of`, the double's own model of TE's
  kernels in `_quantize.py` and `_gemm.py`; nothing here imports snip_megatron);
- what the module ran is recorded in `last_run` and counted in `run_counts` (tests read them);
  a recipe the double does not model, or shapes TE refuses, are recorded and then refused.

The quantized weight workspace (`_fp8_workspaces`, TE `get_weight_workspace`, base.py:1395-1522;
linear.py:253-281, layernorm_linear.py:288-312): a quantized forward gets its weight operand from
`_weight_workspace`. With `is_first_microbatch=None` (no cache name) it quantizes the live weight;
otherwise the workspace cached under "weight" is reused as it is when `is_first_microbatch` is
False (stale if the weight changed since), re-quantized in place from the live weight when it is
True, and created and stored when there is none. A workspace is kept as the high-precision values
it was quantized from (`WeightWorkspace.values`): weight quantization rounds to nearest in every
recipe, so quantizing those values gives TE's cached bits. The fprop and dgrad GEMMs read them;
the weight gradient goes to the live parameter (`_GemmOperands`).

TE's reference NVFP4 tensor (a CustomRecipe with the reference factory) is a storage, not a
torch.Tensor: `get_weight_workspace`'s `internal=False` does not change that
(NVFP4QuantizerRef.quantize always returns an NVFP4TensorRef, quantization_nvfp4.py:687-718), so
`prepare_for_saving` empties the cached object when a forward saves it for backward
(quantization_nvfp4.py:237-246) and that forward's backward refills it (`restore_from_saved`).
A forward that reuses it while it is empty raises TE's RuntimeError (linear.py:277
`update_usage`, quantization_nvfp4.py:285-303); one with `is_first_microbatch=True` refills it
(`update_quantized`, quantization_nvfp4.py:720-764). Built-in recipes' workspaces are
torch.Tensors, saved as they are, never emptied. Their usage check (base.py:1453-1477) is modelled:
an MXFP8 / NVFP4 workspace made without column-wise data, or an FP8 one without a transpose on
GPUs without non-TN FP8 GEMMs, is made again when a forward needs it.

Fused weight-gradient accumulation (`fuse_wgrad_accumulation=True`, linear.py:832-867, 943-964;
layernorm_linear.py:843-872, 994-1009): the wgrad GEMM writes `weight.main_grad` in FP32 (or
main_grad's dtype), accumulating unless `is_first_microbatch` is True or `overwrite_main_grad` is
set; a CustomRecipe's GEMM (custom_recipes/gemm.py:19-31, 137-148) ignores `out` and
`accumulate` and returns a new tensor, which TE then drops, so main_grad is left as it was. Then
TE sets `grad_added_to_main_grad` and returns `get_dummy_wgrad(...)` when the weight has that
attribute (Megatron's DDP), else None.

Stochastic rounding (NVFP4 gradients) draws from `sr_generator`, a CPU generator per module
(TE uses the CUDA Philox stream); tests copy its state to reproduce a module's rounding.

Not modelled: a workspace re-quantized in place between a forward and that forward's backward
(TE's built-in cached workspace is the saved tensor, so that backward's dgrad would read the new
bits; the double's dgrad reads what its forward read); `skip_fp8_weight_update` (CUDA graphs);
FSDP's workspace gather; CPU offloading.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from transformer_engine._double import VERSION
from transformer_engine.common.recipe import Recipe, unmodelled_switches
from transformer_engine.pytorch.module import _formats
from transformer_engine.pytorch.module._gemm import quantized_linear
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.utils import assert_dim_for_fp8_exec, is_non_tn_fp8_gemm_supported


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by {d}")
    return n // d


_SR_SEEDS = itertools.count(20_140)
_dummy_wgrads: dict = {}
WORKSPACE_STATES = ("none", "created", "refreshed", "reused")


@dataclass(frozen=True)
class QuantizedRun:
    """What the last forward of a double's module ran (`module.last_run`)."""

    quantized: bool
    """An enabled FP8/FP4 autocast was active."""
    recipe: Optional[Recipe]
    """The autocast's recipe (TE's `fp8_meta["recipe"]`); None in high precision."""
    quantizer_recipe: Optional[Recipe]
    """The recipe whose settings the module's quantizers carry (differs from `recipe` after a
    same-family switch, TE issue #3157)."""
    formats: Optional[str]
    """The double's name for the numerics the GEMMs ran ('blockwise', 'tensorwise', 'mxfp8',
    'nvfp4'); None in high precision or when refused."""
    refused: Optional[str] = None
    """The error message when the double does not model the recipe (NotImplementedError), the
    double's GPU cannot run it (RuntimeError, TE's kernel checks) or TE refuses the shapes or the bias
    (ValueError / RuntimeError, `_forward_checks`)."""
    spec: Optional[object] = None
    """The quantizers the GEMMs ran, a `_gemm.LinearQuantizers` (None in high precision or when
    refused); `spec.short_str()` names each operand's."""
    weight_workspace: str = "none"
    """Where the quantized weight came from: "none" (no cached workspace: quantized from the live
    weight, `is_first_microbatch=None`, or high precision), "created" (quantized from the live
    weight and cached), "refreshed" (the cached one re-quantized from the live weight,
    `is_first_microbatch=True`), "reused" (the cached one as it was, `is_first_microbatch=False`:
    the weight as it was when last quantized)."""

    @property
    def label(self) -> str:
        return self.formats or ("refused" if self.refused else "high_precision")


@dataclass
class WeightWorkspace:
    """A cached quantized weight (TE `module._fp8_workspaces["weight"]`), kept as the high-precision
    values it was quantized from."""

    values: Optional[torch.Tensor]
    """A copy of the weight when it was last quantized; None while TE's reference NVFP4 tensor is
    emptied (saved for a backward that has not run yet)."""
    storage: str
    """TE's storage class: "float8" (current scaling), "float8_blockwise", "mxfp8", "nvfp4", or
    "reference_nvfp4" (a CustomRecipe's NVFP4TensorRef, emptied when saved for backward)."""
    columnwise: bool
    """It holds column-wise data (or, for FP8, a transpose): the quantizer's usage when made."""


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """The attributes Megatron reads on TE parameters (TP-sharded or not, along which dim)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """TE 2.14 base.py:81-95: one shared, uninitialised buffer per (shape, dtype), zeroed on request,
    returned in place of the weight gradient once it went into main_grad (on the CPU here; TE's is
    on the GPU). Megatron's own linears import it too (tensor_parallel/layers.py)."""
    key = (*shape, dtype)
    if key not in _dummy_wgrads:
        _dummy_wgrads[key] = torch.empty(shape, dtype=dtype, requires_grad=False)
    if zero:
        _dummy_wgrads[key].fill_(0)
    return _dummy_wgrads[key].detach()


def _refuse_unmodelled(module: str, **options) -> None:
    on = [name for name, value in options.items() if value]
    if on:
        raise NotImplementedError(f"transformer_engine test double: {module}({', '.join(on)}) is "
                                  f"not modelled (userbuffers / tp-comm-overlap, delayed wgrad "
                                  f"and symmetric all-reduce are GPU features)")


def _ignores_stateless_pickles() -> bool:
    """TE 2.16.1, 2.17.1 and >= 2.18 skip a checkpoint's pickled stateless recipe (#3123, backported
    to the 2.16 and 2.17 patch releases: pytorch/_extra_state.py is absent at v2.16 and v2.17)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", VERSION)
    major, minor, patch = (int(g or 0) for g in match.groups())
    return (major, minor) >= (2, 18) or ((major, minor) in ((2, 16), (2, 17)) and patch >= 1)


def _refuse_unmodelled_switches(recipe: Recipe) -> None:
    """The fields TE >= 2.15 reads from NVTE_BACKWARD_OVERRIDE, NVTE_NVFP4_ROW_SCALED_ACTIVATION and
    NVTE_NVFP4_4OVER6 (common/recipe's `unmodelled_switches`): the double runs TE 2.14's recipes only."""
    found = unmodelled_switches(recipe)
    if found:
        raise NotImplementedError(f"transformer_engine test double: {type(recipe).__name__}({', '.join(found)}) "
                                  "is not modelled (TE >= 2.15 environment switches; SNIP refuses them at start-up)")


def _storage(recipe: Recipe) -> str:
    """The QuantizedTensorStorage class TE quantizes a weight into for `recipe` (WeightWorkspace.storage)."""
    if recipe.custom():
        return "reference_nvfp4"
    if recipe.nvfp4():
        return "nvfp4"
    if recipe.mxfp8():
        return "mxfp8"
    if recipe.float8_block_scaling():
        return "float8_blockwise"
    return "float8"


def _workspace_invalid(workspace: WeightWorkspace, columnwise: bool) -> bool:
    """TE 2.14 base.py:1453-1477: a cached workspace lacking the usage this forward needs is made
    again (Float8 only where FP8 GEMMs need a transpose; the reference tensor is never checked)."""
    if not columnwise or workspace.columnwise:
        return False
    if workspace.storage in ("mxfp8", "nvfp4"):
        return True
    return workspace.storage == "float8" and not is_non_tn_fp8_gemm_supported()


def _shape(tensor: torch.Tensor) -> str:
    return "(" + ",".join(str(d) for d in tensor.shape) + ")"  # TE's to_string_like, util/string.h


def _check_quantizable(storage: str, tensor: torch.Tensor) -> None:
    """TE 2.14 csrc/quantizer.cpp: MXFP8 (1349-1351) and NVFP4 (1742-1746) tensors need both flattened
    dims divisible by their block (32 / 16), checked when a quantizer makes one for a linear's
    input, weight or output gradient (RuntimeError, NVTE_CHECK). Blockwise FP8 and current scaling
    pad; the reference NVFP4 quantizer pads too (its GEMM checks shapes, `_check_reference_qgemm`)."""
    first, last = math.prod(tensor.shape[:-1]), tensor.shape[-1]
    if storage == "mxfp8" and (first % 32 or last % 32):
        raise RuntimeError(f"MXFP8 requires tensor dims that are divisible by 32 (got shape={_shape(tensor)})")
    if storage == "nvfp4":
        if first % 16:
            raise RuntimeError(f"First dim for NVFP4 must be divisible by 16 (got shape={_shape(tensor)})")
        if last % 16:
            raise RuntimeError(f"NVFP4 requires tensor dims that are divisible by 16 (got shape={_shape(tensor)})")


def _check_reference_rht(tokens: int) -> None:
    """TE 2.14 quantization_nvfp4.py:397-411 (`_apply_rht`): the reference quantizer's Hadamard
    transform of a column-wise (transposed) copy runs along the token dim: a multiple of 16."""
    if tokens % 16:
        raise ValueError(f"Inner dimension {tokens} must be divisible by hadamard dimension 16")


def _check_reference_qgemm(k: int, n: int, bias=None) -> None:
    """TE 2.14 NVFP4QuantizerRef.qgemm (quantization_nvfp4.py:814-815, 874-882): no bias, K % 32 and
    N % 8 (fprop: K = in, N = out; dgrad: K = out, N = in; wgrad: K = tokens, N = in)."""
    if bias is not None:
        raise ValueError("Bias is not supported in NVFP4QuantizerRef.qgemm")
    if k % 32 != 0:
        raise ValueError(f"K dimension must be divisible by 32, got K={k}")
    if n % 8 != 0:
        raise ValueError(f"N dimension must be divisible by 8, got N={n}")


_FP8_GEMM_K_MESSAGE = {
    "float8": "Leading dimension requirement on A for FP8 GEMM. Caller must pad.",
    "float8_blockwise": "Leading dimension requirement on NVTE_BLOCK_SCALING GEMM. Caller must pad.",
}
"""TE 2.14 common/gemm/cublaslt_gemm.cu: cuBLAS's FP8 GEMMs need every operand's leading dimension
(the GEMM's inner dim K) divisible by 16: tensor scaling :158-162 (A), :250-254 (B); block scaling
:207-210 (A), :293-296 (B). MXFP8 / NVFP4 quantizers already need 32 / 16 (`_check_quantizable`)."""


def _fp8_backward_checks(storage: str, out_features: int, *, wgrad: bool, dgrad: bool) -> Callable:
    """The FP8 GEMMs' K % 16 in the backward pass: dgrad's K is the local out_features, wgrad's the
    tokens of the output gradient (the input's rows as the GEMM sees them, gathered under SP).
    Forward's K is in_features, which TE's shape assert already holds to 16. Tensor scaling is
    checked as on Hopper's TN-only GEMMs on every GPU (on SM100 TE's non-TN layouts check outer
    dims instead, cublaslt_gemm.cu:137-147): as strict as SNIP's shape rule (te/shapes.py)."""

    def checks(grad_output: torch.Tensor) -> None:
        tokens = math.prod(grad_output.shape[:-1])
        for needed, k in ((dgrad, out_features), (wgrad, tokens)):
            if needed and k % 16:
                raise RuntimeError(f"{_FP8_GEMM_K_MESSAGE[storage]} (K={k}; transformer_engine test double)")

    return checks


@dataclass
class _WgradRoute:
    """Where a backward's weight gradient goes (TE's wgrad GEMM epilogue and what `backward` returns
    for the weight, linear.py:832-867, 943-964)."""

    weight: torch.nn.Parameter
    fuse: bool
    is_first_microbatch: Optional[bool]
    custom: bool
    """A CustomRecipe GEMM: its result is a new tensor; `out` / `accumulate` are ignored."""
    overwrite_main_grad: bool
    """`overwrite_main_grad` as TE reads it (Linear: on the parameter; LayerNormLinear: on the
    weight operand, which in FP8/FP4 is the workspace and so never has it)."""

    def weight_grad(self, grad_weight: torch.Tensor) -> Optional[torch.Tensor]:
        """What autograd receives for the weight, after main_grad got what TE writes there."""
        if not self.fuse:
            return grad_weight.to(self.weight.dtype)
        weight = self.weight
        main_grad = weight.get_main_grad() if hasattr(weight, "__fsdp_param__") else weight.main_grad
        if not self.custom:  # cuBLAS writes main_grad: D = dW (+ main_grad), FP32 accumulation
            accumulate = (not self.is_first_microbatch if self.is_first_microbatch is not None
                          else True) and not self.overwrite_main_grad
            total = main_grad.float() + grad_weight.float() if accumulate else grad_weight
            main_grad.copy_(total)
        if hasattr(weight, "grad_added_to_main_grad"):  # Megatron's DDP
            weight.grad_added_to_main_grad = True
            return get_dummy_wgrad(list(main_grad.shape), weight.dtype,
                                   zero=getattr(weight, "zero_out_wgrad", False))
        return None


class _GemmOperands(torch.autograd.Function):
    """The two operands of a quantized linear's GEMMs: X passes through, W becomes the values its
    GEMMs read (the workspace's, copied exactly). Backward routes G_W to the live weight as TE does
    (`_WgradRoute`) and refills an emptied reference workspace (TE's `restore_from_saved`, which
    runs in every backward of the layer, hence X passes through here too)."""

    @staticmethod
    def forward(ctx, inp, weight, values, dtype, route: _WgradRoute, refill):
        ctx.route, ctx.refill = route, refill
        inp_out, weight_out = inp.view_as(inp), values.to(dtype=dtype, copy=True)
        if not ctx.needs_input_grad[0]:
            ctx.mark_non_differentiable(inp_out)
        if not ctx.needs_input_grad[1]:  # frozen weight: no wgrad GEMM, as TE's requires_wgrad
            ctx.mark_non_differentiable(weight_out)
        return inp_out, weight_out

    @staticmethod
    def backward(ctx, grad_inp, grad_weight):
        if ctx.refill is not None:
            ctx.refill()
        weight_grad = ctx.route.weight_grad(grad_weight) if ctx.needs_input_grad[1] else None
        return (grad_inp if ctx.needs_input_grad[0] else None), weight_grad, None, None, None, None


class _HighPrecisionGemm(torch.autograd.Function):
    """Y = X W^T (+ b) in high precision under fused wgrad accumulation: forward and dgrad as
    F.linear, dW in FP32 (TE's wgrad GEMM writes main_grad's dtype, linear.py:857-859) routed to
    main_grad (`_WgradRoute`)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, route: _WgradRoute):
        ctx.save_for_backward(inp, weight, bias)
        ctx.route = route
        return F.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight, bias = ctx.saved_tensors
        grad_inp = grad_bias = grad_weight = None
        if ctx.needs_input_grad[0] or (bias is not None and ctx.needs_input_grad[2]):
            # F.linear's own backward for dX and db: the same numbers as without fusion
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (inp, weight, bias) if t is not None]
                y = F.linear(*leaves[:2], leaves[2] if bias is not None else None)
                grads = torch.autograd.grad(y, [leaves[0]] + leaves[2:], grad_output, allow_unused=True)
            grad_inp = grads[0] if ctx.needs_input_grad[0] else None
            grad_bias = grads[1] if bias is not None and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            grad_weight = ctx.route.weight_grad(
                grad_output.reshape(-1, grad_output.shape[-1]).float().t()
                @ inp.reshape(-1, inp.shape[-1]).float())
        return grad_inp, grad_weight, grad_bias, None


class _BackwardChecks(torch.autograd.Function):
    """Identity on a GEMM output whose backward runs `checks(grad_output)` first: TE's refusals
    that come in the backward pass (the reference NVFP4 recipe's dgrad and wgrad GEMMs)."""

    @staticmethod
    def forward(ctx, out, checks: Callable):
        ctx.checks = checks
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.checks(grad_output)
        return grad_output, None


class TransformerEngineBaseModule(torch.nn.Module):
    """Quantization state of one TE module (see the module docstring)."""

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        if FP8GlobalStateManager.with_fp8_parameters():
            raise NotImplementedError(
                "transformer_engine test double: FP8/FP4 weight storage "
                "(quantized_model_init / fp8_model_init with enabled=True, Megatron's "
                "--fp8-param-gather / fp8_param) is not modelled")
        self.name = name
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_initialized = False
        self.fp8_meta_tensors_initialized = False
        """TE's flag (base.py:653, 748, 810): the module holds quantizers; False makes the next quantized
        forward build them from that forward's recipe (SNIP sets it after a resume)."""
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.tp_group = None
        self.tp_size = 1
        self.tp_group_initialized = False
        self.sequence_parallel = False
        self.activation_dtype: Optional[torch.dtype] = None
        self.last_run: Optional[QuantizedRun] = None
        self.run_counts: collections.Counter = collections.Counter()
        self._held_recipe: Optional[Recipe] = None
        self.quantizers: Optional[dict] = None
        """A CustomRecipe's quantizers by role, from its qfactory (None for the built-in recipes)."""
        self._fp8_workspaces: dict = {}
        """TE's cached quantized weights by name ("weight"): WeightWorkspace objects."""
        self.sr_generator = torch.Generator().manual_seed(next(_SR_SEEDS))

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def _set_tp(self, tp_group, tp_size: int) -> None:
        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(tp_group)
        else:
            self.tp_size = torch.distributed.get_world_size(tp_group)
            self.set_tensor_parallel_group(tp_group)

    def _set_parallel_mode(self, parallel_mode, sequence_parallel: bool) -> None:
        """TE's feature split: column mode shards out_features, row mode in_features, over TP."""
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":
            self.out_features = _divide(self.out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = _divide(self.in_features, self.tp_size)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel

    def _init_param(self, param: torch.nn.Parameter, init_fn, get_rng_state_tracker,
                    rng_tracker_name: Optional[str] = None) -> None:
        """TE's reset_parameters for one parameter: init under the RNG tracker's fork."""
        if get_rng_state_tracker is None:
            init_fn(param)
            return
        with get_rng_state_tracker().fork(*([rng_tracker_name] if rng_tracker_name else [])):
            init_fn(param)

    def _check_activation_dtype(self, inp: torch.Tensor) -> None:
        if torch.is_autocast_enabled():
            self.activation_dtype = torch.get_autocast_dtype("cuda")
            return
        for name, param in self.named_parameters(recurse=False):
            if param is not None and param.dtype != inp.dtype:
                raise TypeError("Data types for parameters must match when outside of autocasted "
                                f"region. Found input dtype: {inp.dtype} and {name!r} dtype: "
                                f"{param.dtype}")
        self.activation_dtype = inp.dtype

    def _prepare_forward(self, inp: torch.Tensor, checks: Optional[Callable] = None):
        """Checks, then the FormatSpec of this forward's GEMMs (None: plain GEMMs). `checks(spec)`:
        the layer's shape and bias checks of a quantized forward (`_forward_checks`)."""
        if self.tp_size > 1 and not self.tp_group_initialized:
            raise RuntimeError("Tensor parallel group not initialized. Call "
                               "set_tensor_parallel_group() before forward pass when tp_size > 1.")
        self._check_activation_dtype(inp)
        return self._quantization_for_forward(checks)

    def _quantization_for_forward(self, checks: Optional[Callable] = None):
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        self.fp8_meta["fp8_checkpoint"] = self.fp8 or self.fp8_calibration
        if not self.fp8:
            # Calibration (amax statistics without quantizing) is not modelled: plain GEMMs.
            self.fp8_initialized = False
            return self._record(QuantizedRun(False, None, None, None))
        original = self.fp8_meta.get("recipe")
        current = FP8GlobalStateManager.get_fp8_recipe()
        if not (self.fp8_initialized and current == original):
            self.fp8_meta["recipe"] = current
            self.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
            held = self._held_recipe if self.fp8_meta_tensors_initialized else None  # base.py:748
            self._held_recipe = _formats.quantizer_recipe(held, current)
            self.fp8_meta_tensors_initialized = True
            if self._held_recipe is current:
                self.quantizers = _formats.make_quantizers(current)
            self.fp8_initialized = True
            if original is not None and not (isinstance(current, type(original))
                                             or isinstance(original, type(current))):
                warnings.warn(f"Recipe type changed from {type(original).__name__} to "
                              f"{type(current).__name__}. This may affect model behavior.")
                self._fp8_workspaces.clear()  # made with the old recipe's quantizers
        held = self._held_recipe
        try:
            _refuse_unmodelled_switches(held)
            _formats.check_kernels(held)
            spec = _formats.quantizers_of(held, self.quantizers)
            if checks is not None:
                checks(held)
        except (NotImplementedError, RuntimeError, ValueError) as error:
            self._record(QuantizedRun(True, current, held, None, refused=str(error)))
            raise
        return self._record(QuantizedRun(True, current, held, spec.recipe, spec=spec), spec)

    # -- extra state: the checkpointed recipe ----------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """TE 2.14 base.py:848-913: an empty uint8 tensor unless the module ran quantized, else the
        pickled recipe and the simple fp8_meta values (delayed scaling's scales are not modelled)."""
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        extra = {k: v for k, v in self.fp8_meta.items()
                 if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list))}
        state = {"recipe": self.fp8_meta["recipe"], "extra_fp8_variables": extra}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Load a checkpoint's extra state as the double's TE version does.

        TE 2.14-2.16.0 and 2.17.0 (v2.14 base.py:915-948): unpickle, take the recipe into fp8_meta
        and build quantizers from it (`init_fp8_meta_tensors`); `fp8_initialized` stays False, so
        the next quantized forward takes the autocast's recipe into fp8_meta, but `set_meta_tensor`
        returns early while the recipe class matches (base.py:747-763): the module keeps the
        checkpoint's quantizers, made under the saving process's environment.
        TE 2.16.1, 2.17.1 and >= 2.18 (#3123; v2.18 base.py:1361-1369, pytorch/_extra_state.py:98-113,
        121-186): a pickle whose recipe is stateless (every built-in recipe but DelayedScaling) is
        ignored; a delayed-scaling one is loaded only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1,
        else RuntimeError."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        if not isinstance(state, torch.Tensor):
            raise RuntimeError("Unsupported checkpoint format.")
        data = state.detach().cpu().numpy().tobytes()
        if _ignores_stateless_pickles():
            delayed = b"DelayedScaling" in data  # _classify_extra_state_pickle: the recipe's global
            if not delayed:
                return
            if os.getenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "0") != "1":
                raise RuntimeError(f"Refusing to load pickled Transformer Engine extra state for "
                                   f"{type(self).__name__}. ... set NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.")
        state = pickle.loads(data)
        self.fp8_meta.update(state.get("extra_fp8_variables", {}))
        recipe = state["recipe"]
        self.fp8_meta["recipe"] = recipe
        held = self._held_recipe if self.fp8_meta_tensors_initialized else None  # init_fp8_meta_tensors
        self._held_recipe = _formats.quantizer_recipe(held, recipe)
        if self._held_recipe is recipe:
            self.quantizers = _formats.make_quantizers(recipe)
        self.fp8_meta_tensors_initialized = True

    def _record(self, run: QuantizedRun, spec=None):
        self.last_run = run
        self.run_counts[run.label] += 1
        return spec

    def _forward_checks(self, recipe: Recipe, inp: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """What TE refuses in a quantized forward of this linear, in TE's order: its FP8 shape
        assert on the local input as TE holds it (Linear: as given; LayerNormLinear: viewed as 2D)
        and the weight (linear.py:176, layernorm_linear.py:159,
        utils.py:479-489), the quantizer's shape check on the input and the weight
        (`_check_quantizable`), and for the reference NVFP4 recipe the Hadamard transform of the
        input's column-wise copy (made when a weight gradient will be needed) and the fprop GEMM's
        bias and shape rules (`_check_reference_qgemm`)."""
        weight = self.weight
        assert_dim_for_fp8_exec(inp, weight)
        storage = _storage(recipe)
        _check_quantizable(storage, inp)
        _check_quantizable(storage, weight)
        if storage == "reference_nvfp4":
            if torch.is_grad_enabled() and weight.requires_grad:
                _check_reference_rht(math.prod(inp.shape[:-1]))
            _check_reference_qgemm(k=weight.shape[1], n=weight.shape[0], bias=bias)

    def _reference_backward_checks(self, weight_shape, wgrad: bool, dgrad: bool, use_bias: bool):
        """The reference NVFP4 recipe's refusals in the backward pass: the Hadamard transform of the
        output gradient's column-wise copy (made unless neither wgrad nor a bias gradient is needed,
        linear.py:578-597), then the dgrad and wgrad GEMMs' K % 32. (The built-in recipes' checks
        of the output gradient's dims are implied by those on the input and the weight.)"""
        out_features, in_features = weight_shape

        def checks(grad_output: torch.Tensor) -> None:
            tokens = math.prod(grad_output.shape[:-1])
            if wgrad or use_bias:
                _check_reference_rht(tokens)
            if dgrad:
                _check_reference_qgemm(k=out_features, n=in_features)
            if wgrad:
                _check_reference_qgemm(k=tokens, n=in_features)

        return checks

    def _weight_workspace(self, weight: torch.Tensor, storage: str, is_first_microbatch: Optional[bool],
                          columnwise: bool, name: str = "weight") -> tuple[WeightWorkspace, str]:
        """TE 2.14 get_weight_workspace (base.py:1395-1522) as Linear / LayerNormLinear call it
        (cache name "weight"; GroupedLinear: "weight<i>", grouped_linear.py:172-183):
        (the workspace this forward reads, how it was got: created / refreshed / reused / none)."""
        cache_name = None if is_first_microbatch is None else name
        update_workspace = is_first_microbatch is None or is_first_microbatch
        workspace = self._fp8_workspaces.get(cache_name) if cache_name is not None else None
        if workspace is not None and _workspace_invalid(workspace, columnwise):
            del self._fp8_workspaces[cache_name]  # base.py:1475-1477
            workspace = None
        values = weight.detach().clone()
        if workspace is None:
            workspace = WeightWorkspace(values=values, storage=storage, columnwise=columnwise)
            if cache_name is None:
                return workspace, "none"
            self._fp8_workspaces[cache_name] = workspace
            return workspace, "created"
        if update_workspace:  # quantize_ in place (update_quantized for the reference tensor)
            workspace.values, workspace.columnwise = values, columnwise
            return workspace, "refreshed"
        return workspace, "reused"

    def _gemm(self, inp: torch.Tensor, gemm_bias: Optional[torch.Tensor], spec, *,
              is_first_microbatch: Optional[bool], columnwise: bool, overwrite_main_grad: bool,
              requires_dgrad: bool, weight: Optional[torch.nn.Parameter] = None,
              cache_name: str = "weight"):
        """Y = X W^T (+ b) with this module's weight: inside an enabled autocast the recipe's three
        quantized GEMMs (`_gemm.quantized_linear`, `spec` its quantizers) on the weight workspace,
        else the plain GEMM; the weight gradient routed as TE routes it (fused accumulation or not).
        `columnwise`: the weight quantizer's column-wise usage (a dgrad GEMM will read it);
        `requires_dgrad`: TE runs the dgrad GEMM (for the reference GEMM's backward checks);
        `weight` / `cache_name`: one GEMM of a GroupedLinear (its `weight<i>`; default `self.weight`)."""
        weight = self.weight if weight is None else weight
        route = _WgradRoute(weight, self.fuse_wgrad_accumulation, is_first_microbatch,
                            custom=False, overwrite_main_grad=overwrite_main_grad)
        if spec is None:
            if not self.fuse_wgrad_accumulation or not weight.requires_grad:
                return F.linear(inp, weight, gemm_bias)
            return _HighPrecisionGemm.apply(inp, weight, gemm_bias, route)
        recipe = self._held_recipe
        storage = _storage(recipe)
        route.custom = storage == "reference_nvfp4"
        workspace, how = self._weight_workspace(weight, storage, is_first_microbatch, columnwise, cache_name)
        self.last_run = replace(self.last_run, weight_workspace=how)
        if workspace.values is None:  # linear.py:277 update_usage on the emptied reference tensor
            raise RuntimeError("Cannot generate FP4 data, even from FP4 data transpose")
        values, refill = workspace.values, None
        if torch.is_grad_enabled() and storage == "reference_nvfp4":
            # prepare_for_saving empties the object this forward saves; its backward refills it.
            def restore_from_saved(workspace=workspace, values=values):
                workspace.values = values
            workspace.values, refill = None, restore_from_saved
        dtype = torch.float32 if self.fuse_wgrad_accumulation else weight.dtype
        x, weight_operand = _GemmOperands.apply(inp, weight, values, dtype, route, refill)
        out = quantized_linear(x, weight_operand, gemm_bias, spec, self.sr_generator)
        if storage in _FP8_GEMM_K_MESSAGE and torch.is_grad_enabled() and out.requires_grad:
            out = _BackwardChecks.apply(out, _fp8_backward_checks(storage, weight.shape[0], wgrad=weight.requires_grad,
                                                                  dgrad=requires_dgrad))
        if storage == "reference_nvfp4" and torch.is_grad_enabled() and out.requires_grad:
            out = _BackwardChecks.apply(out, self._reference_backward_checks(
                tuple(weight.shape), wgrad=weight.requires_grad, dgrad=requires_dgrad,
                use_bias=gemm_bias is not None))
        return out
