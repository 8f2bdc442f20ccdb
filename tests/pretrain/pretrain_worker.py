"""snip-pretrain-gpt (snip-pretrain-hybrid with PROBE_FAMILY=hybrid) with a probe on its
controller: what the model Megatron built and the first batch look like, per rank, written to OUT/rank<r>.json; with Transformer Engine's linears, what
every planned TE linear was told to run and what it ran, after each step, in
OUT/rank<r>_te.jsonl, with its run-time state at the end of the step (`te_runtime`): whether TE
fuses its weight-gradient accumulation, whether its weight moved over the step, its `main_grad`,
and where its quantized forward got the weight from (the TE double's weight workspace); and what
each TE core attention last attended (`attention`: CP size, query and key tokens).

    python tests/pretrain/pretrain_worker.py OUT <Megatron-LM and --snip* arguments>

A script that runs SNIP's Megatron-LM set-up itself (the patched Megatron-LM main) gets the same
probe from `install_probe(OUT)`.

PROBE_BUILD_WITHOUT_RECIPE=1 makes SNIP's layer spec leave `quant_recipe` unset (as a model
builder that never calls the spec function would): the planned linears are built without a plan
and must get it at the first step.

With the TE test double on PYTHONPATH (tests/te_double), SNIP reads the GPU generation from the
double's capability (TE_DOUBLE_COMPUTE_CAPABILITY; `snip_megatron.te.gpu.current_sm` is the one
place it is read, patched here): the CPU stands in for an H100 or a B200.
"""

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_megatron.pretrain import setup  # noqa: E402


def use_the_doubles_gpu() -> bool:
    """Point SNIP's GPU query at the TE double's capability; False without the double."""
    try:
        from transformer_engine.pytorch.utils import get_device_compute_capability
    except ImportError:
        return False
    from snip_megatron.te import gpu

    def current_sm() -> int:
        major, minor = get_device_compute_capability()
        return major * 10 + minor

    gpu.current_sm = current_sm
    import torch

    # Megatron-LM's argument check of --moe-grouped-gemm reads the GPU's capability from torch
    torch.cuda.get_device_capability = lambda device=None: get_device_compute_capability()
    return True


def te_state(chunks) -> dict:
    """{"<layer>.<linear>": [planned precision, last run label, last run spec]} of the TE linears."""
    from snip_megatron.megatron.apply import precision_of

    out = {}
    for pl in te_linears(chunks):
        run = getattr(pl.module, "last_run", None)
        spec = None if run is None or run.spec is None else run.spec.short_str()
        out[str(pl.key)] = [str(precision_of(pl.module)), None if run is None else run.label, spec]
    return out


def te_linears(chunks) -> list:
    """The planned linears of this rank that are TE linears."""
    from snip_megatron.megatron.apply import is_te_linear, list_planned_linears

    return [pl for pl in list_planned_linears(chunks) if is_te_linear(pl.module)]


def gemm_weights(module) -> list:
    """A TE linear's weight, or a grouped expert linear's weight<i> (one per expert GEMM)."""
    n = getattr(module, "num_gemms", None)
    return [module.weight] if n is None else [getattr(module, f"weight{i}") for i in range(n)]


def te_weights(chunks) -> dict:
    """{"<layer>.<linear>": a copy of its weight (a grouped linear's: its experts' stacked)} of the TE linears."""
    return {str(pl.key): torch_cat([w.detach() for w in gemm_weights(pl.module)]) for pl in te_linears(chunks)}


def torch_cat(tensors):
    import torch

    return torch.cat(tensors).clone()


def te_runtime(chunks, at_start: dict) -> dict:
    """{"<layer>.<linear>": its run-time state} of the TE linears at the end of a step, right after
    Megatron's train_step (before SNIP's step-end hook), against `at_start` (te_weights before the
    step, before SNIP's step-start hook and any measurement):

    - fused: TE was built with `fuse_wgrad_accumulation` (Megatron's gradient-accumulation fusion);
    - moved: the weight changed over the step;
    - main_grad: max |weight.main_grad| (None without one). Megatron's train_step zeroes the grad
      buffers at its start (`zero_grad_buffer`), not after the optimizer step, so at step end
      main_grad holds exactly this step's accumulated weight gradient;
    - workspace: where the last quantized forward took its weight from (`last_run.weight_workspace`:
      none, created, refreshed, reused; "none" also for a high-precision forward);
    - cache_is_step_start: the cached quantized weight (`_fp8_workspaces["weight"]`) holds the
      weight as it was at the step's start (None: no cached one, or emptied);
    - cache_off: `disable_parameter_transpose_cache` (TE quantizes the weight at every micro-batch)."""
    import torch

    out = {}
    for pl in te_linears(chunks):
        key, module = str(pl.key), pl.module
        before = at_start[key]
        weights = gemm_weights(module)
        grads = [getattr(w, "main_grad", None) for w in weights]
        main_grad = None if any(g is None for g in grads) else torch.cat([g.reshape(-1) for g in grads])
        run = getattr(module, "last_run", None)
        caches = [getattr(module, "_fp8_workspaces", {}).get("weight" if len(weights) == 1 else f"weight{i}")
                  for i in range(len(weights))]
        cached = None if any(c is None or c.values is None for c in caches) else torch.cat([c.values for c in caches])
        out[key] = {
            "fused": bool(getattr(module, "fuse_wgrad_accumulation", False)),
            "moved": not torch.equal(torch_cat([w.detach() for w in weights]), before),
            "main_grad": None if main_grad is None else float(main_grad.detach().abs().max()),
            "workspace": None if run is None else run.weight_workspace,
            "cache_is_step_start": None if cached is None else torch.equal(cached, before),
            "cache_off": bool(getattr(module, "disable_parameter_transpose_cache", False)),
        }
    return out


def attention(chunks) -> dict:
    """{module name: [CP size, query tokens, key tokens]} of what each TE core attention (the
    double's DotProductAttention) last attended."""
    return {name: [m.cp_size, *m.last_tokens] for c in chunks for name, m in c.named_modules()
            if getattr(m, "last_tokens", None) is not None}


def probe(controller, out: Path):
    """Record the model and the first batch at the controller's first two hooks, and the TE
    linears (what they ran, their run-time state) after every step."""
    import torch.distributed as dist

    on_train_start, on_step_start = controller.on_train_start, controller.on_step_start
    on_step_end = controller.on_step_end
    at_start: dict = {}

    def start(ctx):
        from megatron.core import parallel_state as ps

        from snip_megatron.megatron.apply import list_planned_linears

        built = te_state(ctx.chunks)  # as Megatron built them
        on_train_start(ctx)
        planned = list_planned_linears(ctx.chunks)
        modules = [(n, type(m).__name__) for c in ctx.chunks for n, m in c.named_modules()]
        record = {"planned": {str(p.key): type(p.module).__name__ for p in planned},
                  "module_types": sorted({t for _, t in modules}),
                  "q_layernorms": sum(n.endswith("q_layernorm") for n, _ in modules),
                  # experts per MoE layer on this rank (Megatron's MoE layers and their experts)
                  "local_experts": sorted({m.num_local_experts for c in ctx.chunks for m in c.modules()
                                           if isinstance(getattr(m, "num_local_experts", None), int)}),
                  # Megatron's token dispatchers and the expert-TP size its expert groups were made with
                  "dispatchers": sorted({type(m.token_dispatcher).__name__ for c in ctx.chunks for m in c.modules()
                                         if hasattr(m, "token_dispatcher")}),
                  "expert_tp": ps.get_expert_tensor_parallel_world_size(),
                  "stages": {str(k): v for k, v in (controller.stages or {}).items()},
                  "plan_source": controller.plan_source,
                  "te_built": built, "te_started": te_state(ctx.chunks)}
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))

    def step_start(ctx, step):
        if step == 1 and ctx.current_batch[0] is not None:
            b = ctx.current_batch[0]
            path = out / f"rank{dist.get_rank()}.json"
            record = json.loads(path.read_text())
            record["batch"] = {k: (None if v is None else list(v.shape)) for k, v in b.items()}
            record["position_ids"] = b["position_ids"][0].tolist()
            record["tokens"] = b["tokens"][0].tolist()
            record["loss_mask"] = b["loss_mask"][0].tolist()
            path.write_text(json.dumps(record))
        at_start.clear()
        at_start.update(te_weights(ctx.chunks))  # before any measurement or plan change
        on_step_start(ctx, step)

    def step_end(ctx, step, metrics=None):
        runtime = te_runtime(ctx.chunks, at_start)  # as train_step left them
        on_step_end(ctx, step, metrics)
        state = te_state(ctx.chunks)
        if state:
            with (out / f"rank{dist.get_rank()}_te.jsonl").open("a") as f:
                plan = {str(k): p.value for k, p in controller.plan.items()}
                f.write(json.dumps({"step": step, "plan": plan, "linears": state, "runtime": runtime,
                                    "attention": attention(ctx.chunks)}) + "\n")

    controller.on_train_start, controller.on_step_start = start, step_start
    controller.on_step_end = step_end
    return controller


def build_without_recipe() -> None:
    """SNIP's layer spec sets no quant_recipe (the user's own, None here, is kept)."""
    from snip_megatron.pretrain import model

    model.merged_recipe = lambda plan, config, vp_stage, **kwargs: kwargs.get("user_recipe")


def install_probe(out: Path) -> None:
    """Every controller SNIP's Megatron-LM set-up makes in this process gets the probe, writing
    under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    make = setup.make_controller
    setup.make_controller = lambda *a, **k: probe(make(*a, **k), out)


def main():
    import os

    use_the_doubles_gpu()
    if os.environ.get("PROBE_BUILD_WITHOUT_RECIPE") == "1":
        build_without_recipe()
    install_probe(Path(sys.argv[1]))
    from snip_megatron.errors import run_cli
    from snip_megatron.pretrain.entry import PROGRAMS, main as pretrain_main

    family = os.environ.get("PROBE_FAMILY", "gpt")  # "hybrid": snip-pretrain-hybrid
    # as the console script runs it
    sys.exit(run_cli(PROGRAMS[family], lambda argv: pretrain_main(argv, family=family), sys.argv[2:]))


if __name__ == "__main__":
    main()
