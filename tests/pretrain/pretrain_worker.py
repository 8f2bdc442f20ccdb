"""snip-pretrain-gpt with a probe on its controller: what the model Megatron built and the first
batch look like, per rank, written to OUT/rank<r>.json; with Transformer Engine's linears, what
every planned TE linear was told to run and what it ran, after each step, in
OUT/rank<r>_te.jsonl.

    python tests/pretrain/pretrain_worker.py OUT <Megatron-LM and --snip* arguments>

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
    return True


def te_state(chunks) -> dict:
    """{"<layer>.<linear>": [planned precision, last run label, last run spec]} of the TE linears."""
    from snip_megatron.megatron.apply import is_te_linear, list_planned_linears, precision_of

    out = {}
    for pl in list_planned_linears(chunks):
        if not is_te_linear(pl.module):
            continue
        run = getattr(pl.module, "last_run", None)
        spec = None if run is None or run.spec is None else run.spec.short_str()
        out[str(pl.key)] = [str(precision_of(pl.module)), None if run is None else run.label, spec]
    return out


def probe(controller, out: Path):
    """Record the model and the first batch at the controller's first two hooks, and the TE
    linears after every step."""
    import torch.distributed as dist

    on_train_start, on_step_start = controller.on_train_start, controller.on_step_start
    on_step_end = controller.on_step_end

    def start(ctx):
        from snip_megatron.megatron.apply import list_planned_linears

        built = te_state(ctx.chunks)  # as Megatron built them
        on_train_start(ctx)
        planned = list_planned_linears(ctx.chunks)
        modules = [(n, type(m).__name__) for c in ctx.chunks for n, m in c.named_modules()]
        record = {"planned": {str(p.key): type(p.module).__name__ for p in planned},
                  "module_types": sorted({t for _, t in modules}),
                  "q_layernorms": sum(n.endswith("q_layernorm") for n, _ in modules),
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
        on_step_start(ctx, step)

    def step_end(ctx, step, metrics=None):
        on_step_end(ctx, step, metrics)
        state = te_state(ctx.chunks)
        if state:
            with (out / f"rank{dist.get_rank()}_te.jsonl").open("a") as f:
                plan = {str(k): p.value for k, p in controller.plan.items()}
                f.write(json.dumps({"step": step, "plan": plan, "linears": state}) + "\n")

    controller.on_train_start, controller.on_step_start = start, step_start
    controller.on_step_end = step_end
    return controller


def build_without_recipe() -> None:
    """SNIP's layer spec sets no quant_recipe (the user's own, None here, is kept)."""
    from snip_megatron.pretrain import model

    model.merged_recipe = lambda plan, config, vp_stage, **kwargs: kwargs.get("user_recipe")


def main():
    import os

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    use_the_doubles_gpu()
    if os.environ.get("PROBE_BUILD_WITHOUT_RECIPE") == "1":
        build_without_recipe()
    make = setup.make_controller
    setup.make_controller = lambda *a, **k: probe(make(*a, **k), out)
    from snip_megatron.errors import run_cli
    from snip_megatron.pretrain.entry import main as pretrain_main

    sys.exit(run_cli("snip-pretrain-gpt", pretrain_main, sys.argv[2:]))  # as the console script runs it


if __name__ == "__main__":
    main()
