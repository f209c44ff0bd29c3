"""Example flows people copy."""
