"""Test-only stand-ins for the Transformer Engine imports the bridge lane cannot run (no TE on CPU)."""
