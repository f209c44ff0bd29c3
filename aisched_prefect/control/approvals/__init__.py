"""Runs in the control plane (trusted): requests for a person's approval, answers proved by who gave them, one execution each; trusts no requester."""
