"""Emulated quantized linear layers: one autograd function (three GEMMs) and Megatron subclasses."""
