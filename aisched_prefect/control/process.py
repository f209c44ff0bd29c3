"""Running a control plane as its own process and driving it as an operator: for tests, benches and demos.

`ControlPlaneProcess` starts `python -m aisched_prefect.control.server`, reads
its ready line, and talks to it over HTTP with the operator token it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from aisched_prefect.control.authority.state import block_body


class ControlPlaneProcess:
    """Start/stop one control plane process; apply blocks and issue credentials with its operator token."""

    def __init__(self, home: Path, *, dask_address: str | None = None, declared: str | None = None,
                 queue: bool = True, env: dict[str, str] | None = None, checkpoint_dir: Path | None = None,
                 dask_tls: Path | None = None) -> None:
        self.home = home
        self.args = ["--port", "0"]
        if dask_address:
            self.args += ["--dask-address", dask_address]
        if declared:
            self.args += ["--declared", declared]
        if not queue:
            self.args.append("--no-queue")
        if dask_tls is not None:
            self.args += ["--dask-tls", str(dask_tls)]
        if checkpoint_dir is not None:
            self.args += ["--checkpoint-dir", str(checkpoint_dir)]
        self.env = {**os.environ, "AISCHED_HOME": str(home), **(env or {})}
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():  # the control plane emits events and resumes suspended runs there
            self.env["PREFECT_API_URL"] = PREFECT_API_URL.value()
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 120) -> "ControlPlaneProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "aisched_prefect.control.server", *self.args],
                                     stdout=subprocess.PIPE, text=True, env=self.env)
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not line or not line[0].strip():
            self.stop()
            raise RuntimeError("the control plane did not start; its error is above")
        self.info = json.loads(line[0])
        token_file = self.info.get("operator_token_file") or str(self.home / "operator.token")
        self.operator_token = Path(token_file).read_text().strip()
        self.http = httpx.Client(base_url=self.url, timeout=60)
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @property
    def url(self) -> str:
        return self.info["url"]

    @property
    def ledger_url(self) -> str:
        return self.info["ledger"]

    def ledger(self) -> Any:
        """The control plane's ledger, read as an auditor would (the database is on the trusted side)."""
        if getattr(self, "_ledger", None) is None:
            from aisched_prefect.ledger import Ledger

            self._ledger = Ledger(self.ledger_url)
        return self._ledger

    # -- as an operator ------------------------------------------------------------------------
    def request(self, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {token or self.operator_token}"} if token != "" else {}
        return self.http.request(method, path, headers=headers, **kw)

    def ok(self, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
        resp = self.request(method, path, token, **kw)
        assert resp.status_code < 400, f"{method} {path}: {resp.status_code} {resp.text}"
        return resp.json()

    def apply(self, kind: str, name: str, block: Any) -> dict[str, Any]:
        return self.ok("POST", f"/v1/config/{kind}/{name}", json=block_body(block))

    def issue(self, principal: str, role: str = "flow", **bindings: Any) -> str:
        return self.ok("POST", "/v1/credentials", json={"principal": principal, "role": role, **bindings})["token"]

    def approver(self, name: str, authority: str) -> str:
        return self.issue(name, role="approver", authority=authority, tenant="approvers")

    def delegate(self, parent: str, token: str | None = None, **body: Any) -> httpx.Response:
        dims = {k: v for k, v in body.items() if k not in ("id", "principal", "authority")}
        return self.request("POST", f"/v1/grants/{parent}/delegate", token, json={
            "id": body["id"], "principal": body["principal"], "authority": body.get("authority"),
            "dimensions": dims})

    def revoke(self, grant_id: str, reason: str = "test", token: str | None = None,
               authority: str | None = None) -> httpx.Response:
        return self.request("POST", f"/v1/grants/{grant_id}/revoke", token,
                            json={"reason": reason, "authority": authority})

    def records(self, flow_run_id: str) -> list[Any]:
        return self.ledger().records(str(flow_run_id))

