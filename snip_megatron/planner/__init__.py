"""Precision planning: the ILP (PuLP/CBC), its exact fallback, the FLOP/time models and baselines."""
