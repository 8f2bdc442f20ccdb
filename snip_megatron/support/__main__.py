"""python -m snip_megatron.support [--write]: docs/support.md (snip_megatron.support.doc)."""

import sys
import warnings

warnings.filterwarnings("ignore")

from snip_megatron.support.doc import main  # noqa: E402

sys.exit(main())
