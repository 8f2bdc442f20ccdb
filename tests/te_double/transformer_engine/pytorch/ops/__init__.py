"""Placeholders for `transformer_engine.pytorch.ops` (TE 2.14's fusible-op API). Megatron names these
classes in annotations and in its TE-op-fuser paths (TEFusedMLP, TEActivationOp, fused residual
RMSNorm: `use_te_op_fuser`, `use_te_activation_func`, `fused_residual_rmsnorm`); the double does
not model the op fuser and refuses to build any of them."""


class FusibleOperation:
    """Base of the placeholders: building one raises NotImplementedError."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"transformer_engine test double: transformer_engine.pytorch.ops."
                                  f"{type(self).__name__} (the TE op fuser) is not modelled")


class Sequential(FusibleOperation): pass
class BasicLinear(FusibleOperation): pass
class Bias(FusibleOperation): pass
class GroupedLinear(FusibleOperation): pass
class LayerNorm(FusibleOperation): pass
class RMSNorm(FusibleOperation): pass
class MakeExtraOutput(FusibleOperation): pass
class AllReduce(FusibleOperation): pass
class ReduceScatter(FusibleOperation): pass
class GELU(FusibleOperation): pass
class GEGLU(FusibleOperation): pass
class SiLU(FusibleOperation): pass
class SwiGLU(FusibleOperation): pass
class ScaledSwiGLU(FusibleOperation): pass
class ReLU(FusibleOperation): pass
class ReGLU(FusibleOperation): pass
