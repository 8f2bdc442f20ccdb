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
  power-of-two switch, `MXFP8BlockScaling`, `NVFP4BlockScaling`, `CustomRecipe`), the autocast
  (`autocast` and the deprecated `fp8_autocast`: nesting, inner wins, `enabled=False` forces high
  precision, state restored on exit), `quantized_model_init` / `fp8_model_init`, and TE's
  per-module recipe bookkeeping (a same-family switch keeps the old quantizers, issue #3157; a
  class change warns);
- numerics: inside an enabled autocast a linear's three GEMMs (fprop, dgrad, wgrad) run OUR exact
  emulation of the recipe, `snip_megatron.emulation.quantized_linear` with
  `FormatSpec.for_precision(...)` (Float8BlockScaling -> blockwise, Float8CurrentScaling ->
  tensorwise, MXFP8BlockScaling -> mxfp8, NVFP4BlockScaling -> nvfp4); variants our formats lack
  (power-of-two block scales, E4M3-only tensorwise, E5M2-gradient blockwise / MXFP8, NVFP4 with
  RHT / stochastic rounding / 2D blocks off, delayed scaling, custom recipes) are recorded on the
  module (`last_run`, `run_counts`) and refused with NotImplementedError naming the variant;
  outside an autocast, plain GEMMs in the activation dtype;
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
fused RoPE / cross entropy / permutation kernels, TE's optimizers, and GPU capability checks
(every recipe "is available"). Those raise NotImplementedError or are absent where Megatron
tolerates an ImportError.
"""

from importlib import metadata

from transformer_engine import common  # noqa: F401
from transformer_engine import pytorch  # noqa: F401

__version__ = str(metadata.version("transformer_engine"))
