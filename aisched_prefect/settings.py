"""Every environment variable and timing of aisched-prefect, in one place.

Flow processes read only `AISCHED_CONTROL_PLANE` and `AISCHED_TOKEN` (where
the control plane is, and the credential that proves who they are). The rest
is the control plane's and the operator CLI's own: a flow that sets them
changes nothing but its own embedded control plane.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Read from `AISCHED_*` environment variables; every field names its variable."""

    model_config = SettingsConfigDict(env_prefix="AISCHED_", extra="ignore")

    control_plane: str | None = Field(
        default=None, description="AISCHED_CONTROL_PLANE: URL(s) of `aisched serve`, comma-separated replicas. "
        "Unset: each flow run starts an embedded control plane of its own.")
    token: SecretStr | None = Field(default=None, description="AISCHED_TOKEN: the credential an operator issued.")
    operator_token: SecretStr | None = Field(
        default=None, description="AISCHED_OPERATOR_TOKEN: an operator's credential, for the operator CLI.")
    home: Path = Field(default_factory=lambda: Path.home() / ".aisched",
                       description="AISCHED_HOME: the control plane's files (ledger, keys, checkpoints).")
    ledger_url: str | None = Field(default=None, description="AISCHED_LEDGER_URL: the control plane's database.")

    # Timings of the control plane.
    watch_seconds: float = Field(default=0.5, gt=0, description="How often running work is checked against authority.")
    inventory_ttl_seconds: float = Field(default=5.0, gt=0, description="How old a read of worker inventories may be.")
    ticket_ttl_seconds: float = Field(default=600.0, gt=0, description="How long a ticket stays valid once issued (it "
                                      "is issued as its run is handed to Dask; a worker refuses it after that).")
    body_lease_seconds: float = Field(
        default=30.0, ge=2, description="A running body the control plane has not renewed for this long is killed.")
    hold_lease_seconds: float = Field(default=300.0, ge=1, description="Lease of each budget hold, renewed while it runs.")
    settle_patience_seconds: float = Field(
        default=120.0, gt=0, description="AISCHED_SETTLE_PATIENCE_SECONDS: how long a run that ended keeps trying to "
        "settle while the ledger's database is unreachable (a restart, a failover), at most half the hold lease: its "
        "holds stay renewed meanwhile, so a finished run is settled by what it used and reported as it ended.")
    max_keep_warm_seconds: float = Field(
        default=3600.0, ge=0, description="AISCHED_MAX_KEEP_WARM_SECONDS: the longest a body may wait warm for the next "
        "run of its key (what @ai_task(keep_warm=...) asks is cut to this; 0 turns warm bodies off).")
    warm_reconcile_seconds: float = Field(
        default=60.0, gt=0, description="AISCHED_WARM_RECONCILE_SECONDS: how often the warm bodies' books are checked "
        "against what the workers report (besides at start and after a reconnect), for an end whose event was lost.")
    warm_linger_seconds: float = Field(
        default=2.0, ge=0, le=3600, description="AISCHED_WARM_LINGER_SECONDS: a warm body whose flow run has nothing "
        "of its key waiting ends after idling this long, three times this while runs of its key still run in that "
        "flow run (the tail of the work, not its keep-warm time), unless its "
        "task asked @ai_task(keep_warm_across_flow_runs=True).")
    top_up_fraction: float = Field(default=0.5, gt=0, le=10, description="A GPU run nearing what its hold covers "
                                   "asks for this share of its est_seconds more.")
    time_limit_grace_seconds: float = Field(
        default=60.0, ge=0, le=86_400, description="AISCHED_TIME_LIMIT_GRACE_SECONDS: a GPU run's est_seconds is its time "
        "limit (Slurm's --time); this long past it (Slurm's OverTimeLimit) it is asked to stop: checkpoint() raises "
        "StopRequested, its body gets SIGTERM. Set the queue's dask-gpu.queue-policy.over-time to the same.")
    time_limit_kill_wait_seconds: float = Field(
        default=30.0, ge=0, le=3600, description="AISCHED_TIME_LIMIT_KILL_WAIT_SECONDS: this long after the stop was "
        "asked (Slurm's KillWait) a run past its time limit is ended, recorded time-limit and charged for what ran. "
        "Set the queue's dask-gpu.queue-policy.kill-wait to the same.")
    approval_wait_seconds: float = Field(default=10.0, gt=0, description="Longest single long-poll for an answer.")
    embedded_start_seconds: float = Field(default=60.0, gt=0, description="How long a runner waits for the embedded "
                                          "control plane it starts to answer.")
    drift_seconds: float = Field(default=30.0, gt=0, description="How often applied blocks are compared with Prefect's.")
    checkpoint_seconds: float = Field(default=60.0, gt=0, description="How often a moved head is signed and published.")
    day_report_seconds: float = Field(default=300.0, gt=0, description="How often the day's usage artifact is rebuilt.")
    queue_sync_seconds: float = Field(default=30.0, gt=0, description="How often the control plane sets the queue's "
                                      "tenant weights on the scheduler again (a restarted scheduler gets them back).")
    hand_over_placed: bool = Field(
        default=True, description="AISCHED_HAND_OVER_PLACED: a run the cluster's queue placed goes straight to its "
        "worker on the control plane's connection to it (dask_gpu.worker.sandbox), not as a Dask task; false sends "
        "every run as a Dask task, as before (a worker older than this release has no `gpu_run`).")
    stop_seconds: float = Field(default=1.5, gt=0, description="On SIGTERM, how long `aisched serve` lets open requests "
                                "finish, and then its Dask client and ledger close, before it exits anyway.")

    session_lease_seconds: float = Field(
        default=60.0, ge=2, description="A flow process that has not asked for its outcomes for this long (from the "
        "end of its last poll) is gone: its runs still waiting in the queue leave it (those running finish and are "
        "settled).")
    outcome_wait_seconds: float = Field(default=20.0, gt=0, description="Longest single long-poll for outcomes "
                                        "(below a proxy's idle timeout).")
    outcome_batch_bytes: int = Field(default=32 * 2**20, gt=0, description="Most result bytes in one outcome poll.")

    scheduler_reconnect_seconds: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="How long the control plane keeps reconnecting to a Dask "
        "scheduler it lost (Dask's own client gives up after 30 s and closes for good).")
    admission_threads: int = Field(default=8, ge=1, le=64, description="How many calls of one runs request are "
                                   "admitted at a time (their holds share the ledger's group commits).")
    max_runs_in_flight: int = Field(default=50_000, gt=0, description="AISCHED_MAX_RUNS_IN_FLIGHT: most AI task runs "
                                    "one credential may have accepted and not ended (429 past it).")
    max_bytes_in_flight: int = Field(default=2 * 2**30, gt=0, description="AISCHED_MAX_BYTES_IN_FLIGHT: most body "
                                     "bytes (function and arguments) one credential may have in flight (429 past it).")
    # Limits on what one caller may send: each refusal (413, 429) names its variable.
    max_call_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="AISCHED_MAX_CALL_BYTES: the largest AI task call (its pickled "
        "function and arguments) the control plane takes on /v1/calls; a larger one is refused (413) before it is read. "
        "Pass large data by reference (a path or URL the task reads).")
    max_request_bytes: int = Field(
        default=1024 * 1024, ge=1024, description="AISCHED_MAX_REQUEST_BYTES: the largest body of any other request "
        "(configuration, credentials, answers).")
    max_open_approvals: int = Field(
        default=100, ge=1, description="AISCHED_MAX_OPEN_APPROVALS: requests one credential may have waiting for a "
        "person at once; one more is refused (429) until some are answered or expire.")

    def ledger(self) -> str:
        if self.ledger_url:
            return self.ledger_url
        self.home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.home / 'ledger.db'}"

    def control_plane_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in (self.control_plane or "").split(",") if u.strip()]


def settings() -> Settings:
    """The settings as the environment says now."""
    return Settings()
