"""snip-analyze as its console script runs it, recording the real module path of every planned
linear of the model the analysis built, by key, in OUT/modules.json (this rank's; the static
recipes are checked against them). Over the TE test double (tests/te_double on PYTHONPATH) SNIP
reads the GPU generation from the double, which stands in for an H100 or a B200
(pretrain_worker.use_the_doubles_gpu). With ANALYZE_BRIDGE_CPU=1 (the bridge lane) Megatron-Bridge
runs on the CPU as in its tests (its LoRA stand-in, then tests/bridge/cpu.py's patches).

    python tests/analyze/analyze_worker.py OUT <snip-analyze arguments>
"""

import json
import os
import re
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def recording(out: Path):
    """MeasureOnce's `on_train_start` that, once it set the all-BF16 plan on the built model, writes
    {module path: key} of its planned linears to OUT/modules.json."""
    from snip_megatron.analyze.megatron_lm import MeasureOnce
    from snip_megatron.megatron.apply import list_planned_linears

    on_train_start = MeasureOnce.on_train_start

    def start(self, ctx):
        on_train_start(self, ctx)
        out.mkdir(parents=True, exist_ok=True)
        # the path below the model (a chunk is wrapped in DDP's and Float16Module's `module.`)
        paths = {re.sub(r"^(module\.)+", "", pl.module_path): str(pl.key) for pl in list_planned_linears(ctx.chunks)}
        (out / "modules.json").write_text(json.dumps(paths))

    return start


def main() -> None:
    from snip_megatron.analyze.cli import PROG, main as analyze
    from snip_megatron.analyze.megatron_lm import MeasureOnce
    from snip_megatron.errors import run_cli
    from tests.pretrain.pretrain_worker import use_the_doubles_gpu

    if os.environ.get("ANALYZE_BRIDGE_CPU") == "1":
        from tests.bridge.te_stub import lora_layers

        lora_layers.install()  # before anything imports megatron.bridge
        from tests.bridge import cpu

        cpu.install()
    use_the_doubles_gpu()
    MeasureOnce.on_train_start = recording(Path(sys.argv[1]))
    sys.exit(run_cli(PROG, analyze, sys.argv[2:]))


if __name__ == "__main__":
    main()
