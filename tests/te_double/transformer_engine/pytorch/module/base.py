"""Test double of `transformer_engine.pytorch.module.base` (TE 2.14): the state every TE module
keeps about the quantization it runs, and the GEMM the linears share.

Per forward (`_quantization_for_forward`, after TE's `init_fp8_metadata` / `set_meta_tensor`):
- outside an enabled autocast the GEMMs are plain (`fp8_initialized` drops back to False);
- inside, the module takes the autocast's recipe and group into `fp8_meta`; a recipe equal to the
  one it already holds changes nothing; a new recipe of the same family keeps the quantizers it
  has (see `_formats.quantizer_recipe`); a change of class warns "Recipe type changed ...";
- a CustomRecipe gets its quantizers from `qfactory(role)` whenever it is (re)initialised, one call
  per te.Linear role (TE's CustomRecipeState protocol), kept in `quantizers`;
- TE's kernel checks on the double's GPU capability (`_formats.check_kernels`) raise RuntimeError;
- what the module ran is recorded in `last_run` and counted in `run_counts` (tests read them);
  a recipe our formats cannot emulate is recorded and then refused with NotImplementedError.

Stochastic rounding (NVFP4 gradients) draws from `sr_generator`, a CPU generator per module
(TE uses the CUDA Philox stream); tests copy its state to reproduce a module's rounding.
"""

from __future__ import annotations

import collections
import itertools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from transformer_engine.common.recipe import Recipe
from transformer_engine.pytorch.module import _formats
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

_SR_SEEDS = itertools.count(20_140)


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
    """Our recipe name the GEMMs ran ('blockwise', 'tensorwise', 'mxfp8', 'nvfp4'); None in high
    precision or when refused."""
    refused: Optional[str] = None
    """The error message when the recipe has no emulation (NotImplementedError) or the double's GPU
    cannot run it (RuntimeError, TE's kernel checks)."""
    spec: Optional[object] = None
    """The snip_megatron FormatSpec the GEMMs ran (None in high precision or when refused)."""

    @property
    def label(self) -> str:
        return self.formats or ("refused" if self.refused else "high_precision")


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """The attributes Megatron reads on TE parameters (TP-sharded or not, along which dim)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def _refuse_unmodelled(module: str, **options) -> None:
    on = [name for name, value in options.items() if value]
    if on:
        raise NotImplementedError(f"transformer_engine test double: {module}({', '.join(on)}) is "
                                  f"not modelled (userbuffers / tp-comm-overlap, delayed wgrad, "
                                  f"fused wgrad accumulation and symmetric all-reduce are GPU "
                                  f"features)")


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

    def _prepare_forward(self, inp: torch.Tensor):
        """Checks, then the FormatSpec of this forward's GEMMs (None: plain GEMMs)."""
        if self.tp_size > 1 and not self.tp_group_initialized:
            raise RuntimeError("Tensor parallel group not initialized. Call "
                               "set_tensor_parallel_group() before forward pass when tp_size > 1.")
        self._check_activation_dtype(inp)
        return self._quantization_for_forward()

    def _quantization_for_forward(self):
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
            self._held_recipe = _formats.quantizer_recipe(self._held_recipe, current)
            if self._held_recipe is current:
                self.quantizers = _formats.make_quantizers(current)
            self.fp8_initialized = True
            if original is not None and not (isinstance(current, type(original))
                                             or isinstance(original, type(current))):
                warnings.warn(f"Recipe type changed from {type(original).__name__} to "
                              f"{type(current).__name__}. This may affect model behavior.")
        held = self._held_recipe
        try:
            _formats.check_kernels(held)
            spec = _formats.format_spec(held, self.quantizers)
        except (NotImplementedError, RuntimeError) as error:
            self._record(QuantizedRun(True, current, held, None, refused=str(error)))
            raise
        return self._record(QuantizedRun(True, current, held, spec.recipe, spec=spec), spec)

    def _record(self, run: QuantizedRun, spec=None):
        self.last_run = run
        self.run_counts[run.label] += 1
        return spec

    def _gemm(self, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec):
        """Y = X W^T (+ b): our exact emulation of the recipe's three GEMMs, or the plain GEMM."""
        if spec is None:
            return F.linear(inp, weight, bias)
        from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear

        return quantized_linear(inp, weight, bias, spec, QuantRuntime(generator=self.sr_generator))
