"""Command-line entry points: snip-train (recipes -> launch command)."""
