"""Runs in the control plane (trusted) at its edge: the HTTP API and what it takes before any route runs; trusts no caller before its credential is proved."""
