"""A contract double of NVIDIA Transformer Engine 2.14 (PyTorch), for CPU tests only.

Transformer Engine (TE) cannot be installed on CPU machines, so the tests prove SNIP's TE path
(`--transformer-impl transformer_engine`) through Megatron-Core's REAL TE wrappers
(`megatron/core/extensions/transformer_engine.py`, megatron-core 0.16.1 and 0.19.2) running over
this package. It is importable as `transformer_engine` only in test processes that put
`tests/te_double` on sys.path / PYTHONPATH before `megatron.core` is imported (Megatron caches
HAVE_TE at import). It is never installed and never shipped; the `transformer_engine-2.14.0.dist-info`
beside it carries the version Megatron reads through importlib.metadata.

It follows TE v2.14 (April 2026): the newest version megatron-core 0.19.2 gates on
(`is_te_min_version("2.14.0")`; 0.16.1 gates up to 2.10). Files followed:
- transformer_engine/common/recipe/__init__.py    -> common/recipe (recipe classes, env switches)
- transformer_engine/pytorch/quantization.py, fp8.py -> pytorch/quantization.py, fp8.py
- transformer_engine/pytorch/module/base.py        -> pytorch/module/base.py (recipe state)
- transformer_engine/pytorch/module/linear.py, layernorm_linear.py, rmsnorm.py, layernorm.py
- transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py
- transformer_engine/pytorch/distributed.py        -> CudaRNGStatesTracker, recompute flags

What it models (the contract Megatron's wrappers rely on):
- the import surface Megatron touches in both lanes (`pytorch.fp8`, `pytorch.tensor`,
  `pytorch.router`, placeholder `pytorch.ops` / `GroupedLinear` classes, `common.recipe`) and
  `__version__` from the distribution metadata;
- `Linear`, `LayerNormLinear` (RMSNorm / LayerNorm fused in; `return_layernorm_output`),
  `RMSNorm`, `LayerNorm`, `DotProductAttention` (causal softmax attention, GQA): TE's
  constructors, parameter names and Megatron's parallel attributes on them, forward signatures
  and return shapes, TP column / row splitting with the same collectives (and sequence
  parallelism), TE's default init under the RNG tracker's fork;
- the recipes (`Format`, `DelayedScaling`, `Float8CurrentScaling`, `Float8BlockScaling` with its
  power-of-two switch, `MXFP8BlockScaling`, `NVFP4BlockScaling` with its NVTE_NVFP4_DISABLE_*
  switches, `CustomRecipe`), the autocast
  (`autocast` and the deprecated `fp8_autocast`: nesting, inner wins, `enabled=False` forces high
  precision, state restored on exit), `quantized_model_init` / `fp8_model_init`, and TE's
  per-module recipe bookkeeping (a same-family switch keeps the old quantizers, issue #3157; a
  class change warns);
- numerics: inside an enabled autocast a linear's three GEMMs (fprop, dgrad, wgrad) run OUR exact
  emulation of the recipe, `snip_megatron.emulation.quantized_linear` with
  `snip_megatron.formats.Formats(...).spec(precision)` (Float8BlockScaling -> blockwise, with TE's
  power-of-two scales by default or FP32 ones under NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, E4M3 or
  HYBRID; Float8CurrentScaling -> tensorwise, E4M3 or HYBRID; MXFP8BlockScaling -> mxfp8;
  NVFP4BlockScaling -> nvfp4, stochastic or (NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1) nearest
  gradient rounding); every run is recorded on the module (`last_run`, with the FormatSpec it ran,
  and `run_counts`); variants our formats lack (power-of-two current scaling, MXFP8 HYBRID, NVFP4
  without RHT or 16x16 weights, delayed scaling, amax epsilons, other block dims) are refused with
  NotImplementedError naming the variant;
- `CustomRecipe` and TE 2.14's qfactory protocol: a module (re)initialised on a custom recipe calls
  `qfactory(role)` once per te.Linear role ("linear_input", "linear_weight", "linear_output",
  "linear_grad_output", "linear_grad_input") and keeps the quantizers; the reference NVFP4 factory
  Megatron is given on GPUs before Blackwell
  (`pytorch/custom_recipes/quantization_nvfp4.nvfp4_ref_rht_2d_quantizer_factory`, resolved by
  Megatron's `fp8_utils._get_custom_recipe(path)`) exists with TE's quantizer settings, and exactly
  its quantizers map to nvfp4 with nearest gradient rounding (TE's reference quantizer has no
  stochastic rounding); any other factory is refused;
- the GPU generation: `pytorch/utils.get_device_compute_capability()` reads
  TE_DOUBLE_COMPUTE_CAPABILITY ("9.0", "10.0"; default 10.0), and TE 2.14's checks run on it:
  `check_recipe_support` at autocast entry (FP8 SM89+, blockwise SM90+, MXFP8 SM100-119), the
  default recipe, `is_*_available`, and two kernel checks at a module's forward (NVFP4 kernels need
  SM100+; on SM100+ blockwise FP8 runs through MXFP8 and needs power-of-two scales), RuntimeError
  as TE raises;
- `CudaRNGStatesTracker` (CPU generator states stand in for CUDA ones).

Deliberate differences from TE: stochastic rounding draws from a CPU generator per module
(`module.sr_generator`, TE uses the CUDA Philox stream), so tests can reproduce it; the amax
reduction group of an autocast is recorded in `fp8_meta["fp8_group"]` but not used (TE 2.14 itself
reduces per-tensor amaxes over TP only for sequence-parallel inputs / gradients, which the double
gets by quantizing the gathered tensor: every other operand is scaled from its local shard, as in
TE); modules build on the CPU whatever device is asked for.

What it does not model: TE's CUDA/cuDNN kernels and their exact rounding (fused norms, flash
attention, FP8 GEMM accumulation, quantize-then-all-gather of FP8 data), userbuffers / tp-comm
overlap, CUDA graphs, FP8/FP4 weight storage (`quantized_model_init(enabled=True)`,
`--fp8-param-gather`), weight-cache reuse across micro-batches (re-quantizing gives the same
numbers), delayed scaling's amax history, amax reductions across TP or DP groups other than the
sequence-parallel gather (the double quantizes the gathered tensor), calibration, FP8 attention,
context parallelism, packed sequences, sliding windows, TE activation checkpointing, fused wgrad
accumulation into `main_grad`, delayed wgrad, the op fuser (`pytorch.ops`), grouped GEMMs (MoE),
fused RoPE / cross entropy / permutation kernels, TE's optimizers, the CUDA version part of TE's
capability checks, the reference quantizer's own arithmetic (its quantizers only carry settings)
and TE's Hadamard sign vector (our emulation uses its own fixed one). Those raise
NotImplementedError or are absent where Megatron tolerates an ImportError.
"""

from importlib import metadata

from transformer_engine import common  # noqa: F401
from transformer_engine import pytorch  # noqa: F401

__version__ = str(metadata.version("transformer_engine"))
