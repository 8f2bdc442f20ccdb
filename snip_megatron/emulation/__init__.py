"""Emulated quantized linear layers: one autograd function (three GEMMs) and Megatron subclasses.

`parallel_linear` imports megatron.core; import it explicitly
(`from snip_megatron.emulation.parallel_linear import QuantColumnParallelLinear`).
"""

from snip_megatron.emulation.quantized_linear import QuantizedLinear, QuantRuntime, quantized_linear

__all__ = ["QuantRuntime", "QuantizedLinear", "quantized_linear"]
