"""Per-layer statistics and the two noise-injected passes, collected with hooks on a measurement step."""
