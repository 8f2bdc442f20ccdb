"""What a Megatron-LM run without a GPU needs: gloo, the CPU shim, Megatron's model-parallel state
set up before `pretrain` (Megatron skips it when it sees no CUDA device), no fused CUDA kernels."""

from __future__ import annotations

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
    import importlib

    flags = list(CPU_FLAGS)
    try:
        importlib.import_module(WGRAD_FUSION_KERNEL)
    except Exception:  # absent, or a CUDA build that cannot load here
        flags.append("--no-gradient-accumulation-fusion")
    try:
        import psutil  # noqa: F401
    except ImportError:
        flags += ["--ckpt-format", "torch"]
    return flags


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
