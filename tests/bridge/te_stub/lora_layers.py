"""Stand-in for `megatron.bridge.peft.lora_layers` (Megatron-Bridge 0.6.2), test-only.

Why: that module does `import transformer_engine.pytorch as te` at module level, unguarded, and
`import megatron.bridge` reaches it (models -> peft.lora -> lora_layers). Transformer Engine cannot
be installed on a CPU machine (a half-installed TE breaks `import megatron.core`), and it must stay
absent so megatron.core keeps HAVE_TE=False and builds its local (non-TE) layers. So this one module
is replaced in sys.modules before megatron.bridge is imported; TE itself is not imported or faked.

What: the four names Bridge imports from it (peft/lora.py, peft/canonical_lora.py). They are
classes so `isinstance` checks and annotations work; building one raises, naming the stand-in, so
a test that reaches LoRA fails loudly instead of training something else. Nothing else is defined.
This is not the TE contract double under tests/te_double/ (that one stands in for TE itself).
"""

from __future__ import annotations

import sys
import types

MODULE = "megatron.bridge.peft.lora_layers"
NAMES = ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear")


def _unavailable(cls, *args, **kwargs):
    raise RuntimeError(f"{cls.__name__} is the bridge lane's test stand-in for {MODULE} "
                       "(Transformer Engine is not installed): LoRA/PEFT does not run in this lane")


def build() -> types.ModuleType:
    """The stand-in module (not yet registered)."""
    module = types.ModuleType(MODULE, __doc__)
    module.IS_TEST_STAND_IN = True
    for name in NAMES:
        setattr(module, name, type(name, (), {"__new__": _unavailable, "__module__": MODULE}))
    return module


def install() -> None:
    """Register the stand-in in sys.modules; refused once megatron.bridge imported the real one."""
    current = sys.modules.get(MODULE)
    if current is not None:
        if getattr(current, "IS_TEST_STAND_IN", False):
            return
        raise RuntimeError(f"{MODULE} is already imported; install the stand-in before megatron.bridge")
    sys.modules[MODULE] = build()
