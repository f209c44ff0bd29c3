"""Example flows people copy.

Importing them first gives Prefect's temporary server time to start on a busy host (Prefect waits 20 s by default;
a host at load 15 needs more), and makes a script that still cannot reach it end on one line saying what to do.
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # before Prefect reads its settings

from aisched_prefect.logs import quiet_expected_outcomes  # noqa: E402

quiet_expected_outcomes()
