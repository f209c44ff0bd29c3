"""A real control plane for tests: `aisched serve` in its own process, driven as an operator would.

Tests talk to it only as a flow (a runner with a credential), an approver or
an operator (HTTP with their tokens); they read its ledger directly only to
check what it recorded, as an auditor with database access would.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from aisched_prefect import AISchedTaskRunner
from aisched_prefect.control.process import ControlPlaneProcess as _Process


@dataclass
class Tenant:
    """One test's slice of the shared control plane: its applied blocks and a flow credential."""

    plane: "ControlPlaneProcess"
    name: str
    principal: str
    token: str
    authority: str
    budget: str
    policy: str | None = None
    cluster: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def runner(self, **kw: Any) -> AISchedTaskRunner:
        return AISchedTaskRunner(control_plane=self.plane.url, credential=self.token, **kw)


class ControlPlaneProcess(_Process):
    """The package's control-plane process, plus test slices of it."""

    def tenant(self, authority: Any, budget: Any, policy: Any = None, cluster: Any = None, *,
               principal: str | None = None, tenant: str | None = None) -> Tenant:
        """Apply this test's blocks under fresh names and issue its flow a credential bound to them."""
        name = f"t-{uuid.uuid4().hex[:8]}"
        principal = principal or f"{name}/nightly"
        self.apply("authority", name, authority)
        self.apply("budget", name, budget)
        if policy is not None:
            self.apply("policy", name, policy)
        if cluster is not None:
            self.apply("cluster", name, cluster)
        token = self.issue(principal, authority=name, budget=name, policy=name if policy is not None else None,
                           cluster=name if cluster is not None else None, tenant=tenant or principal.split("/")[0])
        return Tenant(self, name, principal, token, name, name, name if policy is not None else None,
                      name if cluster is not None else None)



def answer_when_asked(plane: ControlPlaneProcess, approver_token: str, *, principal: str, approve: bool = True,
                      reason: str = "looks right", timeout: float = 90, alive: Any = None) -> dict[str, Any] | None:
    """As a person would: wait until `principal` has a run waiting for approval, then answer it with an approver's
    credential at the control plane. Returns the approval as answered, or None if none was asked (or `alive()` ended)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and (alive is None or alive()):
        waiting = [a for a in plane.ok("GET", "/v1/approvals", approver_token) if a["principal"] == principal]
        if waiting:
            return plane.ok("POST", f"/v1/approvals/{waiting[0]['id']}/answer", approver_token,
                            json={"approve": approve, "reason": reason})
        time.sleep(0.2)
    return None
