"""Model shapes: the few numbers that fix a Llama-like GPT's linear layers (no torch, no Megatron)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-like decoder: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, untied embeddings."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """SwiGLU inner width (the first MLP linear produces 2x this: gate and up)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA); equal to num_attention_heads for plain multi-head attention."""
    vocab_size: int = 32000
    """Vocabulary size (padded by Megatron to a TP-friendly multiple)."""
    seq_length: int = 2048
    """Training sequence length."""
    kv_channels: "int | None" = None
    """Channels per attention head (Megatron's kv_channels); None: hidden_size / num_attention_heads."""
    gated_linear_unit: bool = True
    """A gated MLP (SwiGLU: the first MLP linear produces 2 x ffn_hidden_size, gate and up); False: one projection."""
    name: str = field(default="custom", compare=False)
    """Preset name, for logs."""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "vocab_size", "seq_length"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{f} must be a positive integer, got {v!r}")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int)
                                             or isinstance(self.kv_channels, bool) or self.kv_channels <= 0):
            raise ValueError(f"ModelShape.kv_channels must be None or a positive integer, got {self.kv_channels!r}")
        if not isinstance(self.gated_linear_unit, bool):
            raise ValueError(f"ModelShape.gated_linear_unit must be True or False, got {self.gated_linear_unit!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"ModelShape.hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"ModelShape.num_attention_heads={self.num_attention_heads} is not "
                             f"divisible by num_query_groups={self.num_query_groups}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **changes)


PRESETS: dict[str, ModelShape] = {
    # Runs on a laptop CPU in minutes; the default of the demo, tests and benchmarks.
    "llama_tiny": ModelShape(name="llama_tiny", num_layers=6, hidden_size=128, ffn_hidden_size=352,
                             num_attention_heads=4, num_query_groups=2, vocab_size=4096,
                             seq_length=128),
    # llama_tiny with multi-latent attention (its widths: models.gpt.PRESET_MLA; every head its own keys).
    "llama_tiny_mla": ModelShape(name="llama_tiny_mla", num_layers=6, hidden_size=128, ffn_hidden_size=352,
                                 num_attention_heads=4, num_query_groups=4, vocab_size=4096, seq_length=128),
    # llama_tiny with MoE layers (4 experts, top-2, every other layer; models.gpt.PRESET_MOE).
    "llama_tiny_moe": ModelShape(name="llama_tiny_moe", num_layers=6, hidden_size=128, ffn_hidden_size=352,
                                 num_attention_heads=4, num_query_groups=2, vocab_size=4096, seq_length=128),
    # llama_tiny with every layer MoE (8 experts, top-2; models.gpt.PRESET_MOE): bench/quality.py's MoE model.
    "llama_tiny_moe8": ModelShape(name="llama_tiny_moe8", num_layers=6, hidden_size=128, ffn_hidden_size=352,
                                  num_attention_heads=4, num_query_groups=2, vocab_size=4096, seq_length=128),
    # TinyLlama-1.1B.
    "llama_1b": ModelShape(name="llama_1b", num_layers=22, hidden_size=2048, ffn_hidden_size=5632,
                           num_attention_heads=32, num_query_groups=4),
    # OpenLLaMA-3B.
    "llama_3b": ModelShape(name="llama_3b", num_layers=26, hidden_size=3200, ffn_hidden_size=8640,
                           num_attention_heads=32, num_query_groups=32),
    "llama_7b": ModelShape(name="llama_7b", num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                           num_attention_heads=32, num_query_groups=32),
    "llama_70b": ModelShape(name="llama_70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                            num_attention_heads=64, num_query_groups=8, vocab_size=32000,
                            seq_length=4096),
}


def get_shape(name: str) -> ModelShape:
    """A preset by name; unknown names raise ValueError listing the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}") from None
