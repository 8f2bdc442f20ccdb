"""Loss and weight divergence: pure functions from a statistics table to a cost table."""
