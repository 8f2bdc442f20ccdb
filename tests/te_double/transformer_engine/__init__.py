"""A contract double of NVIDIA Transformer Engine 2.14 (PyTorch), for CPU tests only.

Transformer Engine (TE) cannot be installed on CPU machines, so the tests prove SNIP's TE path
(`--transformer-impl transformer_engine`) through Megatron-Core's REAL TE wrappers
(`megatron/core/extensions/transformer_engine.py`, megatron-core 0.16.1 and 0.19.2) running over
this package. It is importable as `transformer_engine` only in test processes that put
`tests/te_double` on sys.path / PYTHONPATH before `megatron.core` is imported (Megatron caches
HAVE_TE at import). It is never installed and never shipped; the `transformer_engine-2.14.0.dist-info`
beside it carries the version Megatron reads through importlib.metadata (a folder from
`tests/te/te_versions.py` put before it makes the double another version: see `_double.py`).

It follows TE v2.14 (April 2026): the newest version megatron-core 0.19.2 gates on
(`is_te_min_version("2.14.0")`; 0.16.1 gates up to 2.10). Files followed:
- transformer_engine/common/recipe/__init__.py    -> common/recipe (recipe classes, env switches)
- transformer_engine/pytorch/quantization.py, fp8.py -> pytorch/quantization.py, fp8.py
- transformer_engine/pytorch/module/base.py        -> pytorch/module/base.py (recipe state, weight
  workspaces, the GEMMs and their weight-gradient route)
- transformer_engine/pytorch/module/linear.py, layernorm_linear.py, rmsnorm.py, layernorm.py
- transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py,
  context_parallel.py                               -> pytorch/attention/
- transformer_engine/pytorch/distributed.py        -> CudaRNGStatesTracker, recompute flags
- transformer_engine/pytorch/custom_recipes/        -> its layout per version, the reference factory
- transformer_engine/pytorch/utils.py               -> the FP8 shape assert, the GPU capability

What it models (the contract Megatron's wrappers rely on):
- the import surface Megatron touches in both lanes (`pytorch.fp8`, `pytorch.tensor`,
  `pytorch.router`, a placeholder `pytorch.ops`, `common.recipe`) and
  `__version__` from the distribution metadata;
- `GroupedLinear` (MoE expert GEMMs, `module/grouped_linear.py`: one GEMM per `m_splits` row
  split under the module's recipe, per-GEMM weight workspaces and fused wgrad, TE's refusals of
  splits its FP8 / MXFP8 / NVFP4 kernels cannot take, extra state);
- `Linear`, `LayerNormLinear` (RMSNorm / LayerNorm fused in; `return_layernorm_output`),
  `RMSNorm`, `LayerNorm`, `DotProductAttention` (causal softmax attention, GQA; context
  parallelism as cp_comm_type 'p2p' computes it, `attention/context_parallel.py`): TE's
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
- numerics: inside an enabled autocast a linear's three GEMMs (fprop, dgrad, wgrad) run the
  double's own quantizers and GEMMs (`pytorch/module/_quantize.py`, `_gemm.py`), written from TE
  2.14's source rule by rule with file:line citations, torch's float8 casts for FP8 elements and
  torchao's E2M1 cast for FP4 ones; nothing in this package imports snip_megatron (tests hold
  SNIP's emulation to the double, `tests/te/test_double_is_not_snip.py`). Recipe to quantizers
  (`pytorch/module/_formats.py`, cited entry by entry): Float8BlockScaling -> 1x128 / 128x128
  blocks, with TE's power-of-two scales by default or FP32 ones under
  NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, E4M3 or HYBRID; Float8CurrentScaling -> one scale per
  tensor, E4M3 or HYBRID; MXFP8BlockScaling -> 1x32 E8M0 blocks; NVFP4BlockScaling -> 1x16 E4M3
  scales on an FP32 tensor scale, RHT on the column-wise input and gradient, 16x16 weight blocks,
  stochastic or (NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1) nearest gradient rounding; every run is
  recorded on the module (`last_run`, with the quantizers it ran, and `run_counts`); variants the
  double does not model (power-of-two current scaling, MXFP8 HYBRID, NVFP4 without RHT or 16x16
  weights, delayed scaling, amax epsilons, other block dims) are refused with
  NotImplementedError naming the variant;
- `CustomRecipe` and TE 2.14's qfactory protocol: a module (re)initialised on a custom recipe calls
  `qfactory(role)` once per te.Linear role ("linear_input", "linear_weight", "linear_output",
  "linear_grad_output", "linear_grad_input") and keeps the quantizers; the reference NVFP4 factory
  Megatron is given on GPUs before Blackwell
  (`pytorch/custom_recipes/quantization_nvfp4.nvfp4_ref_rht_2d_quantizer_factory`, resolved by
  Megatron's `fp8_utils._get_custom_recipe(path)`) exists with TE's quantizer settings, and exactly
  its quantizers map to nvfp4 with nearest gradient rounding (TE's reference quantizer has no
  stochastic rounding); any other factory is refused;
- TE's run-time state (module/base.py): the per-module quantized-weight workspace
  (`_fp8_workspaces`) created, re-quantized or reused as `is_first_microbatch` asks (None / True /
  False) and cleared on a recipe class change only, so a stale cached weight is computed with as
  in TE (`last_run.weight_workspace` says which); `fuse_wgrad_accumulation=True`: the weight
  gradient accumulated (or overwritten) in FP32 into `weight.main_grad`, `grad_added_to_main_grad`
  set and TE's dummy wgrad returned (`get_dummy_wgrad`), and a CustomRecipe's GEMM dropping it as
  TE's does; the reference NVFP4 workspace emptied while saved for backward (a reuse before that
  backward raises TE's RuntimeError); TE's shape refusals (the FP8 shape assert, MXFP8 / NVFP4
  quantizer dims, the reference GEMM's bias, K and Hadamard-length rules);
- the GPU and CUDA: `pytorch/utils.py` reads TE_DOUBLE_COMPUTE_CAPABILITY ("9.0", "10.0"; default
  10.0), TE_DOUBLE_CUDA_VERSION (torch.version.cuda; default "13.0") and
  TE_DOUBLE_CUBLASLT_VERSION (tex.get_cublasLt_version(); default from the CUDA version) on every
  call (TE lru-caches its checks; tests change these mid-process), and TE 2.14's checks run on
  them: `check_recipe_support` at autocast entry (FP8 SM89+ with Ada's cuBLASLt >= 12.1.3 and CUDA
  >= 12.1, blockwise SM90+ with CUDA >= 12.9, MXFP8 SM100-119) and `autocast_enter`'s asserts
  (FP8 for every recipe, NVFP4 SM100+), the default recipe, `is_*_available(return_reason=...)`
  with TE's reasons, and two kernel checks at a module's forward (NVFP4 kernels need SM100+; on
  SM100+ blockwise FP8 runs through MXFP8 and needs power-of-two scales);
- the version: `__version__`, the `custom_recipes` layout (quantization_nvfp4 below 2.16,
  quantization_ref_nvfp4 for 2.16-2.18, reference_nvfp4 after) and the recipes' environment
  switches (`common/recipe`: NVTE_BACKWARD_OVERRIDE from 2.15 on every recipe class,
  NVTE_NVFP4_ROW_SCALED_ACTIVATION from 2.16, NVTE_NVFP4_4OVER6* from 2.17, each cited per version
  at v2.14, v2.16, v2.18 and main) follow the dist-info first on sys.path; the linears' behaviour
  stays TE 2.14's (a CustomRecipe is refused on >= 2.16, and so is a recipe whose 2.15+ fields
  leave TE's default);
- `CudaRNGStatesTracker` (CPU generator states stand in for CUDA ones).

Deliberate differences from TE: stochastic rounding draws from a CPU generator per module
(`module.sr_generator`, TE uses the CUDA Philox stream), so tests can reproduce it; the amax
reduction group of an autocast is recorded in `fp8_meta["fp8_group"]` but not used (TE 2.14 itself
reduces per-tensor amaxes over TP only for sequence-parallel inputs / gradients, which the double
gets by quantizing the gathered tensor: every other operand is scaled from its local shard, as in
TE); modules build on the CPU whatever device is asked for; `autocast` restores the state when
`autocast_enter`'s assert fires (TE leaves it set, see pytorch/quantization.py).

Also test-only, beside it: `tests/apex_double/fused_weight_gradient_mlp_cuda.py`, apex's wgrad
accumulation extension that Megatron's local linears (the GPT output layer) call under
gradient-accumulation fusion.

What it does not model: TE's CUDA/cuDNN kernels and their exact rounding (fused norms, flash
attention, FP8 GEMM accumulation, quantize-then-all-gather of FP8 data), userbuffers / tp-comm
overlap, CUDA graphs, FP8/FP4 weight storage (`quantized_model_init(enabled=True)`,
`--fp8-param-gather`), delayed scaling's amax history, amax reductions across TP or DP groups
other than the sequence-parallel gather (the double quantizes the gathered tensor), calibration,
FP8 attention,
context parallelism other than 'p2p' (and the p2p ring, its kernels and per-step RNG states), packed
sequences, sliding windows, TE activation checkpointing, delayed
wgrad, the op fuser (`pytorch.ops`), single grouped weights (GroupedTensor), fused RoPE / cross entropy / permutation
kernels, TE's optimizers, the reference quantizer's own arithmetic (its quantizers only carry
settings), TE >= 2.16's
QuantizerRole qfactory protocol (and any other 2.16+ behaviour), a weight workspace re-quantized
between a forward and its own backward (TE's dgrad would read the new bits), FP8 GEMMs' BF16 bias
for FP32 activations (linear.py:285-290), `skip_fp8_weight_update` / CUDA graphs. Those raise
NotImplementedError or are absent where Megatron tolerates an ImportError, except the last three,
where the double computes as described in module/base.py.
"""

from transformer_engine import common  # noqa: F401
from transformer_engine import pytorch  # noqa: F401
from transformer_engine._double import VERSION

__version__ = VERSION
