"""Runs offline (the simulator, benches): queue policies replayed over a workload with baselines and figures; no cluster, no Prefect, trusts nothing it was not given."""
