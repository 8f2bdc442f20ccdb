"""What a Megatron-LM run without a GPU needs: gloo, the CPU shim, Megatron's model-parallel state
set up before `pretrain` (Megatron skips it when it sees no CUDA device), no fused CUDA kernels;
and, on a GPU, the flags that turn off the fused paths whose kernels are not installed."""

from __future__ import annotations

import os
from functools import partial

# Megatron-LM flags a CPU run needs (no fused CUDA kernels, gloo, local layer spec); the user's own
# flags come after these, so a value given on the command line still wins.
CPU_FLAGS = [
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
]


WGRAD_FUSION_KERNEL = "fused_weight_gradient_mlp_cuda"
"""apex's extension Megatron's local linears call for gradient-accumulation fusion (Megatron-LM's
default): where it is absent, a CPU run turns the fusion off."""


def cpu_flags() -> list[str]:
    """CPU_FLAGS, plus `--no-gradient-accumulation-fusion` where apex's wgrad-fusion kernel is
    absent (Megatron's local linears refuse to build without it), and the per-rank `torch`
    checkpoint format where psutil is missing (Megatron's default torch_dist writer starts worker
    processes through psutil)."""
    flags = list(CPU_FLAGS)
    if not _importable(WGRAD_FUSION_KERNEL):
        flags.append("--no-gradient-accumulation-fusion")
    try:
        import psutil  # noqa: F401
    except ImportError:
        flags += ["--ckpt-format", "torch"]
    return flags


GPU_KERNEL_FLAGS = (
    ("--no-rope-fusion", "Transformer Engine's fused RoPE"),
    ("--no-gradient-accumulation-fusion", "apex's fused_weight_gradient_mlp_cuda"),
    ("--no-masked-softmax-fusion", "the scaled_(upper_triang_)masked_softmax_cuda kernels"),
    ("--no-persist-layer-norm", "apex (without it Megatron's torch norm refuses persist_layer_norm)"),
)
"""Megatron-LM's fused paths that are on by default and the kernels they need: on a GPU without
them, Megatron fails (at config validation, at the first forward or in the local linears) unless
the flag turns the path off. The other fusions (bias-GeLU/SwiGLU, bias-dropout) are jit-compiled."""


def missing_gpu_kernels() -> dict[str, str]:
    """{flag: what is missing} for GPU_KERNEL_FLAGS, read from what is installed here."""
    have = {
        # Megatron's own test (TransformerConfig): its TE extension's fused RoPE, None without TE
        "--no-rope-fusion": _megatron_has_fused_rope,
        "--no-gradient-accumulation-fusion": lambda: _importable(WGRAD_FUSION_KERNEL),
        "--no-masked-softmax-fusion": lambda: (_importable("scaled_masked_softmax_cuda")
                                               and _importable("scaled_upper_triang_masked_softmax_cuda")),
        "--no-persist-layer-norm": lambda: _importable("apex"),
    }
    return {flag: what for flag, what in GPU_KERNEL_FLAGS if not have[flag]()}


def gpu_flags(log=print) -> list[str]:
    """The flags of `missing_gpu_kernels` (none with TE and apex, as in NGC images), said in one line
    (on the first rank) when there are any."""
    missing = missing_gpu_kernels()
    if missing and os.environ.get("RANK", "0") == "0":
        log("[snip] this GPU lacks fused kernels Megatron-LM uses by default, so SNIP adds "
            + ", ".join(f"{flag} (no {what})" for flag, what in missing.items()))
    return list(missing)


def _importable(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # absent, or a build that cannot load here
        return False
    return True


def _megatron_has_fused_rope() -> bool:
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except Exception:
        return False
    return (getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None
            or getattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None) is not None)


def patch_arguments_for_cpu() -> None:
    """Megatron's argument checks ask the GPU's architecture when TP > 1; there is none on CPU."""
    from megatron.training import arguments as marguments

    if hasattr(marguments, "get_device_arch_version"):
        marguments.get_device_arch_version = lambda: 0


def prepare_cpu(args) -> None:
    """gloo process group, the CPU shim and Megatron's model-parallel state, before `pretrain`."""
    from megatron.training import training as mtraining

    from snip_megatron.megatron import runtime

    runtime.quiet_megatron_warnings()
    runtime.init_process_group(backend="gloo", timeout_s=60.0 * args.distributed_timeout_minutes)
    runtime.initialize_model_parallel(tp=args.tensor_model_parallel_size,
                                      pp=args.pipeline_model_parallel_size,
                                      vpp=args.virtual_pipeline_model_parallel_size, seed=args.seed,
                                      ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                                      cp=args.context_parallel_size)
    mtraining.initialize_megatron = partial(mtraining.initialize_megatron, allow_no_cuda=True)


def skip_prebuilt_helpers() -> None:
    """Megatron-LM compiles its dataset helpers with `make` at start-up; the megatron-core wheel
    ships them prebuilt and without the Makefile, so compile only when the import fails."""
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers

    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    dataset_utils.compile_helpers = compile_helpers
