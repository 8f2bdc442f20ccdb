"""Number formats (BF16, FP8, FP4) and their exact fake quantizers; pure torch, any device."""
