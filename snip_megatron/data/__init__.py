"""Real text in: corpus sources, a local BPE tokenizer and Megatron indexed datasets."""
