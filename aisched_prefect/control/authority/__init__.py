"""Runs in the control plane (trusted, holds the signing key): who a caller is, credentials, grants, applied configuration, state folded from the evidence."""
