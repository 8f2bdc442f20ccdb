"""A compact training loop built from Megatron-Core parts, with step hooks for the controller."""
