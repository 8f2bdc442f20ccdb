"""snip-pretrain-gpt with a probe on its controller: what the model Megatron built and the first
batch look like, per rank, written to OUT/rank<r>.json.

    python tests/pretrain/pretrain_worker.py OUT <Megatron-LM and --snip* arguments>
"""

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_megatron.pretrain import setup  # noqa: E402


def probe(controller, out: Path):
    """Record the model and the first batch at the controller's first two hooks."""
    import torch.distributed as dist

    on_train_start, on_step_start = controller.on_train_start, controller.on_step_start

    def start(ctx):
        from snip_megatron.megatron.apply import list_planned_linears

        on_train_start(ctx)
        planned = list_planned_linears(ctx.chunks)
        modules = [(n, type(m).__name__) for c in ctx.chunks for n, m in c.named_modules()]
        record = {"planned": {str(p.key): type(p.module).__name__ for p in planned},
                  "module_types": sorted({t for _, t in modules}),
                  "q_layernorms": sum(n.endswith("q_layernorm") for n, _ in modules),
                  "stages": {str(k): v for k, v in (controller.stages or {}).items()},
                  "plan_source": controller.plan_source}
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

    controller.on_train_start, controller.on_step_start = start, step_start
    return controller


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    make = setup.make_controller
    setup.make_controller = lambda *a, **k: probe(make(*a, **k), out)
    from snip_megatron.pretrain.entry import main as pretrain_main

    sys.exit(pretrain_main(sys.argv[2:]))


if __name__ == "__main__":
    main()
