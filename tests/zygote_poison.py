"""A flow module whose module-level code changes the process that imports it (tests/test_zygote_tenants.py)."""

import builtins

builtins.AISCHED_POISONED_BY = "team-a"  # what a malicious module would do to cloudpickle, made visible
