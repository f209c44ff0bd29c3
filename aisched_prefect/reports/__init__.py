"""Runs where a person reads (the CLI, the flow): evidence and ledger rows turned into tables of runs, usage and cost; read-only, trusts the chain it verified."""
