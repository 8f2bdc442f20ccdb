"""snip-pretrain-gpt on a Megatron whose loop reaches one of SNIP's wrapped functions by another
route: after SNIP's set-up, the Megatron caller of BYPASS (train_step: `train`; save_checkpoint:
`save_checkpoint_and_time`) gets its own copy of its module's globals holding Megatron's original
function, as a Megatron that looked it up elsewhere would. SNIP must stop the run, naming it.

    python tests/pretrain/bypass_worker.py train_step|save_checkpoint <Megatron-LM and --snip* arguments>
"""

import sys
import types
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snip_megatron.pretrain import seams  # noqa: E402

CALLERS = {"train_step": "train", "save_checkpoint": "save_checkpoint_and_time"}


def bypassing(name: str):
    """seams.install, then Megatron's caller of `name` calls the original instead of SNIP's wrapper."""
    install = seams.install

    def install_then_bypass(run):
        from megatron.training import training as mtraining

        original = getattr(mtraining, name)
        install(run)
        caller = getattr(mtraining, CALLERS[name])
        own = {**vars(mtraining), name: original}
        setattr(mtraining, CALLERS[name], types.FunctionType(caller.__code__, own, caller.__name__,
                                                             caller.__defaults__, caller.__closure__))
    return install_then_bypass


if __name__ == "__main__":
    seams.install = bypassing(sys.argv.pop(1))
    from snip_megatron.pretrain.entry import cli

    cli()
