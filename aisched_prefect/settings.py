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
    top_up_fraction: float = Field(default=0.5, gt=0, le=10, description="A GPU run nearing what its hold covers "
                                   "asks for this share of its est_seconds more.")
    approval_wait_seconds: float = Field(default=10.0, gt=0, description="Longest single long-poll for an answer.")
    embedded_start_seconds: float = Field(default=60.0, gt=0, description="How long a runner waits for the embedded "
                                          "control plane it starts to answer.")
    drift_seconds: float = Field(default=30.0, gt=0, description="How often applied blocks are compared with Prefect's.")
    checkpoint_seconds: float = Field(default=60.0, gt=0, description="How often a moved head is signed and published.")
    day_report_seconds: float = Field(default=300.0, gt=0, description="How often the day's usage artifact is rebuilt.")
    queue_sync_seconds: float = Field(default=30.0, gt=0, description="How often the control plane sets the queue's "
                                      "tenant weights on the scheduler again (a restarted scheduler gets them back).")
    stop_seconds: float = Field(default=1.5, gt=0, description="On SIGTERM, how long `aisched serve` lets open requests "
                                "finish, and then its Dask client and ledger close, before it exits anyway.")

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
