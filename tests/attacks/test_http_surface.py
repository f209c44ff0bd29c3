"""The control plane's HTTP surface shows nothing about a run to a visitor who may not see it, and takes no form
post from another site.

Before: `/openapi.json` answered anyone; `/approve/{id}` showed any visitor the requester's principal, task, grant
chain and budget left; no page carried X-Frame-Options or a Content-Security-Policy, and a form posted from another
site (with a credential the attacker planted, or the approver's own) was taken.
"""

from __future__ import annotations

from urllib.parse import urlencode

import pytest

from aisched_prefect import ai_task
from tests.approval_helpers import RawCall
from tests.helpers import ask_for_training, authority, tenant

pytestmark = pytest.mark.usefixtures("prefect_api")


@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=30)
def secret_finetune_project(lr: float = 0.1) -> str:
    return f"trained at {lr}"


def _form(plane, approval_id, token, **headers):
    body = urlencode({"token": token, "decision": "approve", "reason": "from elsewhere"})
    return plane.http.post(f"/approve/{approval_id}", content=body,
                           headers={"content-type": "application/x-www-form-urlencoded", **headers})


def test_nothing_about_a_run_is_shown_without_a_credential_that_may_see_it(control_plane):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert control_plane.http.get(path).status_code == 404, path
    b = tenant(control_plane, authority_=authority(principal="team-b/secret-project"), policy=ask_for_training(120),
               principal="team-b/secret-project")
    other = tenant(control_plane, principal="team-c/nosy")  # another tenant: a flow and an approver of its own
    nosy_approver = control_plane.approver("alice", other.authority)
    alice = control_plane.approver("alice", b.authority)
    call = RawCall(b, secret_finetune_project, 0.3)
    try:
        reply, _ = call.send()
        assert reply.status == "approval-pending", reply
        view = reply.approval
        secrets_ = ("team-b/secret-project", "secret_finetune_project", "team-a-root", b.budget, view.flow_run_id)
        for token in (None, other.token, nosy_approver, "ais_0000000000000000_forged"):
            headers = {"authorization": f"Bearer {token}"} if token else {}
            page = control_plane.http.get(f"/approve/{view.id}", headers=headers)
            assert page.status_code == 401, (token, page.status_code)
            assert not [s for s in secrets_ if s in page.text], (token, page.text)
            assert "Sign in" in page.text
        # Nor with a short id, nor through the API, nor in another authority's approver's list.
        assert control_plane.http.get(f"/approve/{view.id[:8]}").status_code == 401
        assert control_plane.request("GET", f"/v1/approvals/{view.id}", nosy_approver).status_code == 403
        assert view.id not in [v["id"] for v in control_plane.ok("GET", "/v1/approvals", nosy_approver)]
        assert view.id in [v["id"] for v in control_plane.ok("GET", "/v1/approvals", alice)]
        shown = control_plane.http.get(f"/approve/{view.id}", headers={"authorization": f"Bearer {alice}"})
        assert shown.status_code == 200 and "team-b/secret-project" in shown.text

        # Every answer keeps the page out of frames and other sites' referrers, and allows no script.
        for resp in (shown, control_plane.http.get("/v1/health")):
            assert resp.headers["x-frame-options"] == "DENY"
            assert resp.headers["referrer-policy"] == "no-referrer"
            csp = resp.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
            assert "script-src" not in csp  # nothing but the default: no script at all

        # A form posted from another site is refused, whatever credential it carries; from the page, it counts.
        for headers in ({"origin": "https://evil.example"}, {"sec-fetch-site": "cross-site"}, {"origin": "null"},
                        {"referer": "https://evil.example/page"}, {"sec-fetch-site": "same-site"}):
            refused = _form(control_plane, view.id, alice, **headers)
            assert refused.status_code == 403 and "cross-site" in refused.text, headers
        assert control_plane.ok("GET", f"/v1/approvals/{view.id}")["status"] == "pending"
        own = _form(control_plane, view.id, alice, origin=control_plane.url, **{"sec-fetch-site": "same-origin"})
        assert own.status_code == 200 and "Recorded: alice approved." in own.text
        done, result = call.send(admission=view.id)
        assert done.status == "completed" and result == "trained at 0.3"
    finally:
        call.close()
