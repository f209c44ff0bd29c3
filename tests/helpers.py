"""Blocks and runners the flow tests build on."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from blocks import ApprovalPolicyBlock, ApprovalRule, AuthorityBlock, BudgetBlock, Grant

PRINCIPAL = "team-a/nightly"
APPROVERS = [Grant(id=f"{name}-approves", principal=name, kinds=["training"], max_gpus=8, max_cost_per_run=100.0,
                   can_approve=True) for name in ("alice", "bob")]


def authority(**grant: Any) -> AuthorityBlock:
    """team-a/nightly's root grant (overridable), plus two people who may approve training runs."""
    fields = {"id": "team-a-root", "principal": PRINCIPAL, "max_gpus": 4, "max_cost_per_run": 10.0}
    return AuthorityBlock(grants=[Grant(**{**fields, **grant}), *APPROVERS])


def budget(limit: float = 100.0) -> BudgetBlock:
    return BudgetBlock(limit=limit, gpu_hour_prices={"H100": 4.0, "A10": 1.0}, token_prices_per_1k={"*": 0.01})


def ask_for_training(timeout: int = 60) -> ApprovalPolicyBlock:
    return ApprovalPolicyBlock(rules=[ApprovalRule(name="training-needs-a-person", kinds=["training"])],
                               timeout_seconds=timeout)


def tenant(plane: Any, *, authority_: AuthorityBlock | None = None, budget_: BudgetBlock | None = None,
           policy: ApprovalPolicyBlock | None = None, cluster: Any = None, principal: str = PRINCIPAL) -> Any:
    """A slice of the shared control plane for one test: its blocks applied, its flow's credential issued."""
    return plane.tenant(authority_ or authority(), budget_ or budget(), policy, cluster, principal=principal)


def resume_when_paused(answer: dict[str, Any], *, flow_name: str | None = None, flow_run_name: str | None = None,
                       timeout: float = 60, alive: Any = None, before: Any = None) -> Any:
    """Wait until the flow run (found by flow name or flow run name) is paused, call `before()` once, then answer
    its form through the Prefect API as the UI does; returns the flow run id, or None if it never paused (or
    `alive()` turned false)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName
    from prefect.flow_runs import resume_flow_run

    filters: dict[str, Any] = (
        {"flow_filter": FlowFilter(name=FlowFilterName(any_=[flow_name]))} if flow_name is not None
        else {"flow_run_filter": FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name]))})
    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while time.time() < deadline and (alive is None or alive()):
            runs = client.read_flow_runs(**filters)
            if runs and runs[0].state and runs[0].state.is_paused():
                if before is not None:
                    before, call = None, before
                    call()
                try:  # the form's schema is saved just after the Paused state: retry briefly
                    resume_flow_run(runs[0].id, run_input=answer)
                    return runs[0].id
                except Exception:
                    pass
            time.sleep(0.2)
    return None


def processes_with(entry: str) -> list[int]:
    """The processes whose environment holds `entry` ("NAME=value", whole): what one process started and its
    children inherited, found without knowing their pids (they may be gone by the time the test looks)."""
    import os

    found, want = [], entry.encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def wait_until(check: Any, timeout: float = 60.0, what: str = "") -> Any:
    """Poll `check()` until it returns something true and return that; fail naming `what` after `timeout` s."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check.__doc__ or check}")


class CuttingProxy:
    """A TCP proxy between a flow and the control plane whose `cut()` drops every open connection at once, as a
    proxy's idle timeout or a network blip does. `cuts`: how many times; `dropped`: connections that were open then."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.open: list = []
        self.lock = threading.Lock()
        self.cuts = self.dropped = 0
        self.clients: set = set()
        self.down_until = 0.0  # monotonic: until then every new connection is closed at once (`down`)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if time.monotonic() < self.down_until:  # the server behind it is restarting: nothing answers
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, upstream]
                self.clients.add(client)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        with self.lock:
            victims, self.open = self.open, []
            self.cuts += 1
            self.dropped += sum(1 for s in victims if s in self.clients and s.fileno() != -1)
            self.clients.clear()
        for s in victims:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def down(self, seconds: float) -> None:
        """The server behind it goes away for `seconds` (a restart): open connections drop, new ones are closed."""
        self.down_until = time.monotonic() + seconds
        self.cut()

    def close(self) -> None:
        self.server.close()
        self.cut()


def workers_info(client: Any) -> dict[str, Any]:
    """Every worker the scheduler has now, by address. `client.scheduler_info()` fetches them and returns the
    client's cached identity, which its periodic refresh (with no workers) may overwrite in between: seen once as
    an empty `workers` in a full run."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def ledger_text(plane: Any) -> str:
    """Every row of every table of the plane's ledger, as text: what someone who can read its database sees."""
    import sqlalchemy as sa

    engine = plane.ledger().engine
    out = []
    with engine.connect() as conn:
        for table in sa.inspect(engine).get_table_names():
            out.extend(str(tuple(row)) for row in conn.execute(sa.text(f'SELECT * FROM "{table}"')))
    return "\n".join(out)


def send_raw(call: Any) -> Any:
    """Send a `RawCall` as a flow process does (`POST /v1/calls`), without fetching its result: the reply as it came."""
    from aisched_prefect.wire import FRAME, Reply, frame, unframe

    resp = call.client._send("POST", "/v1/calls", content=frame(call.meta.model_dump_json().encode(), call.blob),
                             headers={"content-type": FRAME})
    return Reply.model_validate_json(unframe(resp.content)[0])
