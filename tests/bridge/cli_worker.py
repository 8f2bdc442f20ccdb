"""snip-bridge-pretrain on CPU, for the bridge lane's tests: Bridge's CPU patches (tests/bridge/cpu.py)
and, with tests/te_double on the path, SNIP reading the double's GPU generation; then the command's
own `main` on the command line a user types (`torchrun ... -m snip_megatron.bridge --recipe ...
KEY=VALUE ...`), exiting with its status."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from te_stub import lora_layers  # noqa: E402

lora_layers.install()


def main() -> int:
    from tests.bridge import cpu
    from tests.pretrain.pretrain_worker import use_the_doubles_gpu

    cpu.install()
    use_the_doubles_gpu()  # False (nothing changed) without the double
    from snip_megatron.bridge import cli

    code = cli.main(sys.argv[1:])
    cpu.uninstall()
    return code


if __name__ == "__main__":
    sys.exit(main())
