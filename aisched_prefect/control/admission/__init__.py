"""Runs in the control plane (trusted): admission as numbered phases over one snapshot of authority, and the record an admitted run carries."""
