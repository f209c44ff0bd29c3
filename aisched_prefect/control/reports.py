"""Reports: what the control plane hands out about what it recorded.

Signed checkpoints of the evidence log's head, published outside the database (a log that no longer
extends the last signed head is refused loudly, never blessed); usage artifacts in Prefect, for one
flow run at its end and for the day on a schedule; and a flow run's records, to the flow that made
its calls (operators: any).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aisched_prefect.control.calls import CallBook
from aisched_prefect.control.authority.credentials import Unauthorized, who
from aisched_prefect.control.authority.identity import Credential
from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import Ledger

logger = logging.getLogger("aisched_prefect.control")


class Reports:
    """Checkpoints of the log (signed with the plane's key), usage artifacts, and a flow run's records."""

    def __init__(self, ledger: Ledger, key: Ed25519PrivateKey, public_key: str, calls: CallBook,
                 checkpoint_dir: Path | None) -> None:
        self.ledger, self.key, self.public_key, self.calls = ledger, key, public_key, calls
        self.checkpoint_dir = checkpoint_dir
        self._checkpointed = -1
        self._signed: tuple[int, str] = (0, "")
        self._day_reported = -1
        self._mine = threading.local()  # each request thread's Prefect client, kept (see `_prefect`)
        self._clients: list[Any] = []
        self._clients_lock = threading.Lock()

    def _prefect(self) -> Any:
        """This thread's Prefect client, opened once and kept: opening one took 22 ms and its first request 12 ms
        more, at every flow run's end (its usage artifact). One per thread: a client is not shared across threads."""
        client = getattr(self._mine, "client", None)
        if client is None:
            from prefect.client.orchestration import get_client

            client = get_client(sync_client=True)
            client.__enter__()
            self._mine.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _drop_prefect(self) -> None:
        """After a failed publish: this thread opens a fresh client next time (the API may have moved or restarted)."""
        client = getattr(self._mine, "client", None)
        self._mine.client = None
        if client is not None:
            with self._clients_lock:
                if client in self._clients:
                    self._clients.remove(client)
            _close_quietly(client)

    def close(self) -> None:
        """The plane stops: every kept Prefect client is closed."""
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            _close_quietly(client)

    def _head(self) -> int:
        import sqlalchemy as sa

        from aisched_prefect.ledger import chain_head

        with self.ledger.reader.connect() as conn:
            return conn.execute(sa.select(chain_head.c.seq)).scalar() or 0

    def publish_day_report(self) -> None:
        """The day's usage artifact, on a schedule (it reads the whole day), when anything new was recorded."""
        if not os.environ.get("PREFECT_API_URL"):
            return
        from aisched_prefect.reports.usage import publish_day_artifact

        head = self._head()
        if head != self._day_reported:
            try:
                publish_day_artifact(self.ledger, client=self._prefect())
            except Exception:
                self._drop_prefect()
                raise
            self._day_reported = head

    def checkpoint_if_moved(self) -> None:
        """A checkpoint, on a schedule, when anything was recorded since the last one."""
        if self._head() != self._checkpointed:
            self._checkpointed = self.checkpoint()["seq"]

    def _last_signed(self) -> tuple[int, str]:
        """The newest head this control plane signed: its published checkpoint (outside the database), else what
        this process signed last, else the start of the log."""
        if self.checkpoint_dir is not None and (self.checkpoint_dir / "latest.json").exists():
            data = json.loads((self.checkpoint_dir / "latest.json").read_text())
            if data.get("public_key") == self.public_key:
                return max((int(data["seq"]), str(data["hash"])), self._signed)
        return self._signed

    def checkpoint(self) -> dict[str, Any]:
        """Sign the head of the log and publish it outside the database (when a directory is configured).

        Only a log that still extends the last signed head is signed: a rewritten history (even one
        rechained so that it verifies on its own) is refused here, loudly, instead of being blessed.
        """
        import sqlalchemy as sa

        from aisched_prefect.evidence import EvidenceRecord, extends
        from aisched_prefect.ledger import evidence

        seq, hash_ = self._last_signed()
        with self.ledger.reader.connect() as conn:
            rows = conn.execute(sa.select(evidence).where(evidence.c.seq >= max(seq, 1)).order_by(evidence.c.seq)).all()
        problem = extends([EvidenceRecord.model_construct(**r._mapping) for r in rows], seq, hash_)
        if problem is not None:
            logger.critical("NOT signing the evidence log: %s", problem)
            raise AISchedError(f"the evidence log no longer extends the last signed checkpoint: {problem}. Fix: "
                               "investigate the database (aisched evidence verify --checkpoint DIR), restore it, "
                               "then sign again")
        cp = self.ledger.checkpoint(self.key)
        self._signed = max(self._signed, (cp.seq, cp.hash))
        out = {**cp.model_dump(), "public_key": self.public_key}
        if self.checkpoint_dir is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            body = json.dumps(out, sort_keys=True).encode()
            (self.checkpoint_dir / f"checkpoint-{cp.seq:012d}.json").write_bytes(body)
            (self.checkpoint_dir / "latest.json").write_bytes(body)
        return out

    def publish_usage(self, caller: Credential, flow_run_id: str) -> dict[str, Any]:
        """Publish the flow run's usage artifact (the ledger is here, not in the flow process); it reads only that
        flow run's records, so a flow run's end costs the same however much the day holds."""
        self._own_flow_run(caller, flow_run_id)
        if not os.environ.get("PREFECT_API_URL"):
            return {"published": [], "reason": "this control plane has no PREFECT_API_URL"}
        from aisched_prefect.reports.usage import publish_flow_run_artifact

        try:
            return {"published": [publish_flow_run_artifact(self.ledger, flow_run_id, client=self._prefect())]}
        except Exception as exc:  # said to the caller, who logs it; never fails its flow
            self._drop_prefect()
            logger.exception("could not publish the usage report artifacts of flow run %s", flow_run_id)
            err = AISchedError(f"the control plane could not publish them to Prefect at {os.environ['PREFECT_API_URL']} "
                               f"({type(exc).__name__}: {exc})")
            err.status = 502  # type: ignore[attr-defined]
            raise err from None

    def flow_run_records(self, caller: Credential, flow_run_id: str) -> list[Any]:
        self._own_flow_run(caller, flow_run_id)
        return self.ledger.records(flow_run_id)

    def _own_flow_run(self, caller: Credential, flow_run_id: str) -> None:
        """A flow reads and publishes only the flow runs it made its calls under (operators: any)."""
        if caller.role == "operator":
            return
        owner = self.calls.owner_of(flow_run_id)
        if owner != who(caller):
            raise Unauthorized(f"{caller.principal!r} ran nothing in flow run {flow_run_id}", 403)


def _close_quietly(client: Any) -> None:
    try:
        client.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - closing a client whose server is gone
        logger.debug("closing a Prefect client failed", exc_info=True)
