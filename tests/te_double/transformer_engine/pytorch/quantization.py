"""Test double of `transformer_engine.pytorch.quantization` (TE 2.14): the global autocast state and
TE's hardware support checks.

Follows TE 2.14's `FP8GlobalStateManager`, `autocast` / `fp8_autocast` and `quantized_model_init`
/ `fp8_model_init`:
- `autocast(enabled, recipe, amax_reduction_group)` saves the whole state, sets its own (so an
  inner context overrides an outer one, and `enabled=False` turns quantization off inside), and
  restores the saved state on exit, however the block ends;
- a recipe of None means TE's default recipe for the GPU (MXFP8 on SM100-119, current scaling on
  SM120+, else `DelayedScaling()`, which the double's linears refuse to run);
- TE's support checks (quantization.py:47-111) on the stood-in GPU and CUDA of `pytorch/utils.py`
  (TE_DOUBLE_COMPUTE_CAPABILITY, TE_DOUBLE_CUDA_VERSION, TE_DOUBLE_CUBLASLT_VERSION), re-read on
  every call where TE caches them: FP8 on SM89+ (on Ada with cuBLASLt >= 12.1.3 and CUDA >= 12.1),
  blockwise FP8 on SM90+ with CUDA >= 12.9, MXFP8 on SM100-119, NVFP4 on SM100+; `is_*_available
  (return_reason=...)` answer with TE's reasons;
- at autocast entry, `check_recipe_support` (RuntimeError: current / delayed scaling, blockwise,
  MXFP8) and then `autocast_enter`'s asserts (AssertionError: FP8 for every enabled recipe, custom
  included, then MXFP8 / blockwise / NVFP4 for theirs; quantization.py:588-599);
- `quantized_model_init(enabled=True)` (FP8/FP4 weight storage) is recorded in the state and
  refused by the double's modules at construction; `enabled=False` is what Megatron opens around
  every TE linear it builds.

Deliberate difference: TE's asserts in `autocast_enter` run after it has set the global state
and outside `autocast`'s try/finally, so a TE process that catches the AssertionError keeps
quantization enabled (and AUTOCAST_DEPTH raised); the double's `autocast` restores the state
before re-raising, so one refused autocast in a test does not leak into the next check.
`FP8GlobalStateManager.autocast_enter` called directly leaks as TE's does.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Optional, Tuple

import torch

from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                              Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe)
from transformer_engine.pytorch.utils import cuda_version, get_cublasLt_version, get_device_compute_capability

__all__ = [
    "autocast", "quantized_model_init", "is_fp8_available", "is_mxfp8_available",
    "is_fp8_block_scaling_available", "is_nvfp4_available", "get_default_recipe",
]


def check_fp8_support() -> Tuple[bool, str]:
    """TE 2.14 quantization.py:47-58."""
    if get_device_compute_capability() >= (9, 0):  # hopper and above
        return True, ""
    if get_device_compute_capability() < (8, 9):  # pre-ada
        return False, "Device compute capability 8.9 or higher required for FP8 execution."
    if get_cublasLt_version() < 120103:
        return False, "CublasLt version 12.1.3.x or higher required for FP8 execution on Ada."
    if float(cuda_version()) < 12.1:
        return False, "Cuda version 12.1 or higher required for FP8 execution on Ada."
    return True, ""


def check_mxfp8_support() -> Tuple[bool, str]:
    """TE 2.14 quantization.py:61-68."""
    if get_device_compute_capability() >= (12, 0):
        return False, "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet."
    if get_device_compute_capability() >= (10, 0):
        return True, ""
    return False, "Device compute capability 10.0 or higher required for MXFP8 execution."


def check_nvfp4_support() -> Tuple[bool, str]:
    """TE 2.14 quantization.py:71-76."""
    if get_device_compute_capability() >= (10, 0):
        return True, ""
    return False, "Device compute capability 10.0 or higher required for NVFP4 execution."


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """TE 2.14 quantization.py:79-87: SM90+ and CUDA >= 12.9."""
    if get_device_compute_capability() >= (9, 0) and float(cuda_version()) >= 12.9:
        return True, ""
    return False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def check_recipe_support(recipe: Optional[Recipe]) -> None:
    """TE 2.14's first check at autocast entry (quantization.py:90-101; NVFP4 and custom recipes
    are checked by `autocast_enter`'s asserts)."""
    supported, reason = True, ""
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        supported, reason = check_fp8_support()
    elif isinstance(recipe, Float8BlockScaling):
        supported, reason = check_fp8_block_scaling_support()
    elif isinstance(recipe, MXFP8BlockScaling):
        supported, reason = check_mxfp8_support()
    if not supported:
        raise RuntimeError(reason)


def get_default_fp8_recipe() -> Recipe:
    """TE 2.14: MXFP8 where it runs, current scaling on SM120+, else delayed scaling."""
    if check_mxfp8_support()[0]:
        return MXFP8BlockScaling()
    if get_device_compute_capability() >= (12, 0):
        return Float8CurrentScaling()
    return DelayedScaling()


def get_default_recipe() -> Recipe:
    return get_default_fp8_recipe()


def _reporting(check):
    def available(return_reason: bool = False):
        return check() if return_reason else check()[0]
    return available


is_fp8_available = _reporting(check_fp8_support)
is_mxfp8_available = _reporting(check_mxfp8_support)
is_fp8_block_scaling_available = _reporting(check_fp8_block_scaling_support)
is_nvfp4_available = _reporting(check_nvfp4_support)


def get_fp8_torch_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    fmt = fp8_recipe.fp8_format
    if fmt == Format.E4M3 or (fmt == Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


class FP8GlobalStateManager:
    """Process-wide quantization state read by every module's forward."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE: Optional[Recipe] = None
    FP8_DISTRIBUTED_GROUP = None
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    IS_FIRST_FP8_MODULE = False
    FP8_GRAPH_CAPTURING = False
    AUTOCAST_DEPTH = 0
    skip_fp8_weight_update_tensor = None

    @classmethod
    def reset(cls) -> None:
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.FP8_PARAMETERS = False
        cls.HIGH_PRECISION_INIT_VAL = cls.IS_FIRST_FP8_MODULE = cls.FP8_GRAPH_CAPTURING = False
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = cls.skip_fp8_weight_update_tensor = None
        cls.AUTOCAST_DEPTH = 0

    @classmethod
    def is_fp8_available(cls):
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls):
        return check_mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls):
        return check_fp8_block_scaling_support()

    @classmethod
    def is_nvfp4_available(cls):
        return check_nvfp4_support()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.FP8_GRAPH_CAPTURING

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first caller inside the outermost autocast, then False."""
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def get_autocast_state(cls) -> tuple:
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING) = state

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        cls.skip_fp8_weight_update_tensor = torch.tensor([float(skip)])

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return cls.skip_fp8_weight_update_tensor

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta) -> None:
        """Delayed scaling's amax buffers: not modelled (the double never runs delayed scaling)."""

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Delayed scaling's amax reduction at the outermost exit: nothing to reduce here."""

    @classmethod
    def autocast_enter(cls, enabled: bool = False, calibrating: bool = False,
                       fp8_recipe: Optional[Recipe] = None, fp8_group=None,
                       _graph: bool = False) -> None:
        """TE 2.14 quantization.py:564-599: set the state, then assert the recipe is available."""
        fp8_recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        cls.FP8_ENABLED = enabled
        cls.FP8_CALIBRATION = calibrating
        cls.FP8_RECIPE = fp8_recipe
        cls.FP8_DISTRIBUTED_GROUP = fp8_group
        cls.FP8_GRAPH_CAPTURING = _graph
        if cls.AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.AUTOCAST_DEPTH += 1
        if enabled:
            fp8_available, reason_for_no_fp8 = cls.is_fp8_available()
            assert fp8_available, reason_for_no_fp8
            if isinstance(fp8_recipe, MXFP8BlockScaling):
                mxfp8_available, reason_for_no_mxfp8 = cls.is_mxfp8_available()
                assert mxfp8_available, reason_for_no_mxfp8
            if isinstance(fp8_recipe, Float8BlockScaling):
                fp8_block_available, reason_for_no_fp8_block = cls.is_fp8_block_scaling_available()
                assert fp8_block_available, reason_for_no_fp8_block
            if isinstance(fp8_recipe, NVFP4BlockScaling):
                nvfp4_available, reason_for_no_nvfp4 = cls.is_nvfp4_available()
                assert nvfp4_available, reason_for_no_nvfp4

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        cls.AUTOCAST_DEPTH -= 1
        if enabled and cls.AUTOCAST_DEPTH == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)


@contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False):
    """Quantize the GEMMs of the TE modules run inside with `recipe` (FP8 or FP4)."""
    if enabled:
        check_recipe_support(recipe)
    saved = FP8GlobalStateManager.get_autocast_state()
    try:
        FP8GlobalStateManager.autocast_enter(enabled=enabled, calibrating=calibrating,
                                             fp8_recipe=recipe, fp8_group=amax_reduction_group,
                                             _graph=_graph)
    except AssertionError:
        # TE leaves the state autocast_enter set (deliberate difference, see the module docstring).
        FP8GlobalStateManager.set_autocast_state(saved)
        FP8GlobalStateManager.AUTOCAST_DEPTH -= 1
        raise
    try:
        yield
    finally:
        FP8GlobalStateManager.set_autocast_state(saved)
        FP8GlobalStateManager.autocast_exit(enabled, _graph=_graph)


@contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None, _graph: bool = False):
    """TE 2.14's deprecated name for `autocast` (what Megatron 0.16/0.19 call)."""
    warnings.warn("fp8_autocast is deprecated and will be removed in a future release. "
                  "Use autocast(enabled=..., calibrating=..., recipe=..., group=..., _graph=...) "
                  "instead.", category=DeprecationWarning, stacklevel=3)
    with autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe,
                  amax_reduction_group=fp8_group, _graph=_graph):
        yield


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """Modules built inside with `enabled=True` would store quantized weights (refused by the double)."""
    saved = (FP8GlobalStateManager.FP8_PARAMETERS, FP8GlobalStateManager.FP8_RECIPE,
             FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL)
    FP8GlobalStateManager.FP8_PARAMETERS = enabled
    FP8GlobalStateManager.FP8_RECIPE = get_default_fp8_recipe() if recipe is None else recipe
    FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL = preserve_high_precision_init_val
    try:
        yield
    finally:
        (FP8GlobalStateManager.FP8_PARAMETERS, FP8GlobalStateManager.FP8_RECIPE,
         FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL) = saved


@contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """TE 2.14's deprecated name for `quantized_model_init`."""
    warnings.warn("fp8_model_init is deprecated and will be removed in a future release. "
                  "Use quantized_model_init(enabled=..., recipe=..., "
                  "preserve_high_precision_init_val=...) instead.",
                  category=DeprecationWarning, stacklevel=3)
    with quantized_model_init(enabled=enabled, recipe=recipe,
                              preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield
