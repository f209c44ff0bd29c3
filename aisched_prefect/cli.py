"""The `aisched` command line: run the control plane, operate it, approve runs, read budgets and evidence.

Changes of authority (credentials, applied configuration, delegations,
revocations, approvals) go through the control plane's API with the caller's
credential. Reading the books (budgets, evidence, reports) is done on the
ledger directly, as an auditor with database access would.

Each command imports what it needs inside its own body: `aisched --help` and a
command that only talks to the control plane load neither Prefect, Dask nor
SQLAlchemy (seconds of start-up each; tests/test_cli_imports.py keeps it so).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from aisched_prefect.errors import AISchedError

if TYPE_CHECKING:
    from aisched_prefect.client import ControlPlaneClient
    from aisched_prefect.ledger import Ledger as LedgerType

app = typer.Typer(help="aisched-prefect: the control plane, its authority, budgets and evidence.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
evidence_app = typer.Typer(help="The hash-chained evidence log.", no_args_is_help=True)
budget_app = typer.Typer(help="Budget accounts in the ledger.", no_args_is_help=True)
app.add_typer(evidence_app, name="evidence")
app.add_typer(budget_app, name="budget")
grants_app = typer.Typer(help="Delegate, revoke and list grants.", no_args_is_help=True)
app.add_typer(grants_app, name="grants")
approvals_app = typer.Typer(help="Runs waiting for a person, and approvers' keys.", no_args_is_help=True)
app.add_typer(approvals_app, name="approvals")
credentials_app = typer.Typer(help="Credentials of flows, approvers and operators.", no_args_is_help=True)
app.add_typer(credentials_app, name="credentials")
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)  # piped output: no 80-column squeeze

PlaneOpt = typer.Option(None, "--control-plane", help="URL of `aisched serve` (default: AISCHED_CONTROL_PLANE).")
TokenOpt = typer.Option(None, "--token-file", help="File holding your token (default: AISCHED_OPERATOR_TOKEN, "
                        "AISCHED_TOKEN, or AISCHED_HOME/operator.token).")


def _plane(url: Optional[str], token_file: Optional[str] = None, *, signed: bool = False) -> "ControlPlaneClient":
    """A client of the control plane with the caller's own token (operator, approver or flow)."""
    from aisched_prefect.client import ControlPlaneClient
    from aisched_prefect.settings import settings

    env = settings()
    urls = [url] if url else env.control_plane_urls()
    if not urls:
        _fail("no control plane address", "pass --control-plane URL or set AISCHED_CONTROL_PLANE (what `aisched serve` printed)")
    token = _token(token_file)
    if token is None and not signed:
        _fail("no credential", "set AISCHED_OPERATOR_TOKEN (operators), AISCHED_TOKEN (approvers), or pass --token-file")
    return ControlPlaneClient(urls, token or "", retry_seconds=3.0)


def _token(token_file: Optional[str]) -> Optional[str]:
    """The caller's token: --token-file, AISCHED_OPERATOR_TOKEN, AISCHED_TOKEN, or this host's operator token file."""
    from pathlib import Path

    from aisched_prefect.settings import settings

    env = settings()
    if token_file:
        return Path(token_file).read_text().strip()
    if env.operator_token is not None:
        return env.operator_token.get_secret_value()
    if env.token is not None:
        return env.token.get_secret_value()
    if (env.home / "operator.token").exists():
        return (env.home / "operator.token").read_text().strip()
    return None


def _fail(what: str, fix: str, code: int = 1) -> None:
    typer.echo(f"error: {what}. Fix: {fix}", err=True)
    raise typer.Exit(code)

LedgerOpt = typer.Option(None, "--ledger", help="Ledger URL (default: AISCHED_LEDGER_URL or ~/.aisched/ledger.db).")


def Ledger(url: Optional[str] = None) -> "LedgerType":  # noqa: N802 - reads as the class it returns
    """The ledger at `url`, imported only by the commands that read the books (SQLAlchemy takes a second to load)."""
    from aisched_prefect.ledger import Ledger as LedgerClass

    return LedgerClass(url)


def _table(title: str, rows: list[dict], columns: list[str]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, overflow="fold")  # a narrow terminal wraps values, never cuts them
    for r in rows:
        table.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in columns))
    return table


@app.command()
def inventory(declared: Optional[str] = typer.Option(None, help="Declared inventory, e.g. '2 GPUs, 80 GB, H100' "
                                                     "or '2 workers x 2 GPUs, 80 GB, H100; 1 worker x 1 GPU, 24 GB, A10'.")) -> None:
    """Show the GPUs this host would advertise as a Dask worker (each worker, for a declared multi-worker spec)."""
    import os

    from dask_gpu import DECLARED_ENV, InventorySpecError, declared_worker_inventories, discover

    spec = declared if declared is not None else os.environ.get(DECLARED_ENV)
    source = "--declared" if declared is not None else DECLARED_ENV
    try:
        invs = declared_worker_inventories(spec, source) if spec is not None and spec.strip() else [discover()]
    except InventorySpecError as exc:
        _fail(str(exc), "correct the spec as the grammar above says", code=2)
    for i, inv in enumerate(invs):
        title = f"worker {i}" if len(invs) > 1 else "devices"
        console.print(f"{title}: source {inv.source}; {inv.describe()}")
        console.print(_table(title, [d.model_dump() for d in inv.devices], ["index", "uuid", "name", "gpu_type", "memory_gb"]))


def _write_keypair(out: str, force: bool = False) -> str:
    """A new Ed25519 key: private half (PEM, 0600) to OUT, public half (PEM) to OUT.pub; returns the public key in hex.

    An existing key is never replaced unless `force`: losing one locks its holder out.
    """
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    from aisched_prefect.control.keys import write_private

    key = Ed25519PrivateKey.generate()
    try:
        write_private(Path(out), key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()), force=force)
    except FileExistsError:
        _fail(f"{out} already exists", "pass --force to replace it (whoever holds the old key can no longer sign)")
    with open(out + ".pub", "wb") as f:
        f.write(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


ForceOpt = typer.Option(False, "--force", help="Replace an existing key file.")


@evidence_app.command("checkpoint")
def evidence_checkpoint(control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Have the control plane sign the head of the log and publish it outside the database (run it on a schedule)."""
    cp = _plane(control_plane, token_file).post("/v1/checkpoints")
    console.print(f"signed checkpoint at record {cp['seq']} ({cp['hash'][:16]}...) with the control plane's key "
                  f"{cp['public_key']}")


def _public_key(path: Optional[str]) -> Optional[bytes]:
    if path is None:
        return None
    if len(path) == 64 and all(c in "0123456789abcdefABCDEF" for c in path):
        return bytes.fromhex(path)
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

    with open(path, "rb") as f:
        return load_pem_public_key(f.read()).public_bytes(Encoding.Raw, PublicFormat.Raw)


@evidence_app.command("verify")
def evidence_verify(ledger: Optional[str] = LedgerOpt,
                    public_key: Optional[str] = typer.Option(
                        None, "--public-key", help="The control plane's public key: a PEM file, or 64 hex digits "
                        "(what `aisched serve` printed). Checks signed checkpoints; pins the key of --checkpoint."),
                    checkpoint: Optional[str] = typer.Option(
                        None, "--checkpoint", help="A checkpoint the control plane published outside the database "
                        "(its --checkpoint-dir, or a file in it): the log must still hold it."),
                    control_plane: Optional[str] = PlaneOpt) -> None:
    """Check the whole chain; exit 1 on any edit, deletion, reordering or truncation, naming the record."""
    from aisched_prefect.evidence import verify_published

    key = _public_key(public_key)
    if checkpoint is not None and key is None:
        key = _control_plane_key(control_plane)
    book = Ledger(ledger)
    from aisched_prefect.evidence import SIG

    first = book.records_after(0, limit=1)
    # A control plane's log is signed from its first record on: then every record must be (none written by others).
    signed = bool(first) and isinstance(first[0].payload, dict) and SIG in first[0].payload
    report = book.verify(key, signed_records=signed and key is not None)
    if report.ok and checkpoint is not None:
        report = verify_published(book.records(), checkpoint, key)
    if report.ok:
        signed = ""
        if checkpoint is not None:
            signed = f"; matches the published checkpoint at record {report.at_seq}, signed by {key.hex()[:16]}..."
        elif key is None:
            signed = " (hash chain only: pass --checkpoint DIR to check against what the control plane published)"
        console.print(f"[green]evidence chain intact[/green]: {report.records} records{signed}")
        return
    console.print(f"[red]evidence chain broken[/red] at record {report.at_seq}: {report.problem}")
    raise typer.Exit(1)


def _control_plane_key(url: Optional[str]) -> bytes:
    """The key a published checkpoint must be signed by: never the one written inside it."""
    import httpx

    from aisched_prefect.settings import settings

    urls = [url] if url else settings().control_plane_urls()
    if not urls:
        _fail("--checkpoint needs the control plane's key to check the signature against",
              "pass --public-key (what `aisched serve` printed), or --control-plane URL to ask it")
    return bytes.fromhex(httpx.get(f"{urls[0]}/v1/health", timeout=10).json()["public_key"])


@evidence_app.command("show")
def evidence_show(flow_run: Optional[str] = typer.Option(None, help="Only this flow run's task runs."),
                  ledger: Optional[str] = LedgerOpt) -> None:
    """One row per attempt of each AI task run (request, principal, grant, worker, reserved, charged, decision),
    then the operators' records apart: credentials, applied configuration, grants."""
    from aisched_prefect.report import MONEY_NOTE, evidence_rows, for_display, operator_rows

    records = Ledger(ledger).records(flow_run)
    rows = [for_display(r) for r in evidence_rows(records)]
    console.print(_table("AI task runs", rows, ["task", "attempt", "principal", "request", "grant", "worker", "devices",
                                                "reserved", "charged", "decision"]))
    console.print(MONEY_NOTE)
    operated = operator_rows(records) if flow_run is None else []
    if operated:
        console.print(_table("operators' records (credentials, configuration, grants)", operated,
                             ["record", "kind", "by", "what"]))


@app.command()
def explain(run_id: str = typer.Argument(..., help="A flow-run or task-run id."), ledger: Optional[str] = LedgerOpt) -> None:
    """Why that run was allowed or denied, under which grant chain, approved by whom, at what cost."""
    from aisched_prefect.report import explain as explain_records

    book = Ledger(ledger)
    records = book.records_about(run_id)
    if not records:
        _fail(f"no evidence records for {run_id} in {book.url}",
              "point at the control plane's ledger: AISCHED_LEDGER_URL, AISCHED_HOME, or --ledger")
    typer.echo(explain_records(records))


@evidence_app.command("export")
def evidence_export(out: Optional[str] = typer.Option(None, help="File to write (default: standard output)."),
                    ledger: Optional[str] = LedgerOpt) -> None:
    """Every record as JSON lines (schema aisched.evidence/1), in chain order."""
    import json
    import sys

    from aisched_prefect.report import export_line

    stream = open(out, "w") if out else sys.stdout
    try:
        for record in Ledger(ledger).records():
            stream.write(json.dumps(export_line(record), sort_keys=True) + "\n")
    finally:
        if out:
            stream.close()


@budget_app.command("show")
def budget_show(
    budget: Optional[str] = typer.Option(None, "--budget", help="Only this budget and the limits under it."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Limit, posted, pending and remaining for each budget account and period (expiring run-out holds first)."""
    book = Ledger(ledger)
    expired = book.expire_holds()  # a hold whose lease ran out is spent money: show it as such
    rows = [r for r in book.accounts() if budget is None or r["budget"] == budget or r["budget"].startswith(budget + "/")]
    for r in rows:
        r["used"] = f"{(r['posted'] + r['pending']) / r['limit']:.0%}" if r["limit"] else "-"
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    console.print(_table("budgets", rows, ["budget", "period", "unit", "limit", "posted", "pending", "remaining", "used"]))
    if expired:
        console.print(f"{len(expired)} hold(s) whose lease ran out were expired and charged in full")


@budget_app.command("history")
def budget_history(
    budget: Optional[str] = typer.Option(None, "--budget", help="Only this budget and the limits under it."),
    task_run: Optional[str] = typer.Option(None, "--task-run", help="Only the holds of this task run."),
    limit: int = typer.Option(50, "--limit", min=1, help="Newest this many holds."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Holds and charges, newest first, with the task runs they belong to."""
    rows = Ledger(ledger).history(budget, task_run_id=task_run, limit=limit)
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    for r in rows:
        r["created"] = datetime.fromtimestamp(r["created_at"]).strftime("%m-%d %H:%M:%S")
    console.print(_table("holds and charges", rows, ["created", "budget", "period", "unit", "status", "reserved",
                                                      "charged", "task_run_id", "principal"]))


def _names(value: Optional[str]) -> Optional[list[str]]:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


@grants_app.command("add-root")
def grants_add_root(
    authority: str = typer.Option(..., help="AuthorityBlock to add the root grant to (created if missing)."),
    id: str = typer.Option(..., "--id"),
    principal: str = typer.Option(..., help="One principal (team-a/nightly), or group:NAME of a declared group."),
    kinds: str = typer.Option("*", help="Comma-separated kinds, or *."),
    models: str = typer.Option("*", help="Comma-separated models, or *."),
    gpu_types: str = typer.Option("*", "--gpu-types", help="Comma-separated GPU types, or *."),
    max_gpus: int = typer.Option(..., "--max-gpus"),
    max_cost: float = typer.Option(..., "--max-cost", help="Max cost per run."),
    max_priority: int = typer.Option(0, "--max-priority", help="Highest queue priority its runs may take (0-100)."),
    expires: Optional[datetime] = typer.Option(None, help="Expiry (ISO 8601, UTC unless given)."),
    can_delegate: bool = typer.Option(False, "--can-delegate"),
    can_approve: bool = typer.Option(False, "--can-approve"),
) -> None:
    """Add a root grant to an AuthorityBlock in Prefect (as the UI's editor would); it applies after `aisched apply`."""
    from blocks import AuthorityBlock, Grant

    try:
        block = AuthorityBlock.load(authority)
    except ValueError:
        block = AuthorityBlock()
    if any(g.id == id for g in block.grants):
        _fail(f"AuthorityBlock {authority!r} already has a grant {id!r}", "choose another --id")
    grant = Grant(id=id, principal=principal, kinds=_names(kinds) or ["*"], models=_names(models) or ["*"],
                  gpu_types=_names(gpu_types) or ["*"], max_gpus=max_gpus, max_cost_per_run=max_cost,
                  max_priority=max_priority, expires_at=expires, can_delegate=can_delegate, can_approve=can_approve)
    updated = block.model_copy(update={"grants": [*block.grants, grant]})
    problems = updated.problems()
    if problems:
        _fail(problems[0], "name one principal, or declare a group in the block and name group:NAME")
    updated.save(authority, overwrite=True)
    console.print(f"added root grant [bold]{id}[/bold] for {principal} to AuthorityBlock {authority!r}; "
                  f"it takes effect once an operator runs `aisched apply --authority {authority}`")


@grants_app.command("delegate")
def grants_delegate(
    parent: str = typer.Argument(..., help="Id of the grant to delegate from (one you hold, or any as an operator)."),
    id: str = typer.Option(..., "--id", help="Id of the new grant."),
    to: str = typer.Option(..., "--to", help="Principal that receives it, e.g. team-a/nightly."),
    authority: Optional[str] = typer.Option(None, help="Operators: the applied authority the parent is in."),
    kinds: Optional[str] = typer.Option(None, help="Comma-separated kinds, within the parent's."),
    models: Optional[str] = typer.Option(None, help="Comma-separated models, within the parent's."),
    gpu_types: Optional[str] = typer.Option(None, "--gpu-types", help="Comma-separated GPU types, within the parent's."),
    max_gpus: Optional[int] = typer.Option(None, "--max-gpus"),
    max_cost: Optional[float] = typer.Option(None, "--max-cost", help="Max cost per run."),
    budget_share: Optional[float] = typer.Option(None, "--budget-share"),
    max_priority: Optional[int] = typer.Option(None, "--max-priority", help="Highest queue priority, within the parent's."),
    expires: Optional[datetime] = typer.Option(None, help="Expiry (ISO 8601, UTC unless given)."),
    can_delegate: bool = typer.Option(False, "--can-delegate"),
    can_approve: bool = typer.Option(False, "--can-approve"),
    control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt,
) -> None:
    """Delegate a narrower grant as its holder; anything wider than the parent is refused, naming the dimension."""
    given = {"kinds": _names(kinds), "models": _names(models), "gpu_types": _names(gpu_types), "max_gpus": max_gpus,
             "max_cost_per_run": max_cost, "budget_share": budget_share, "max_priority": max_priority,
             "expires_at": expires.isoformat() if expires else None, "can_delegate": can_delegate or None,
             "can_approve": can_approve or None}
    dims = {k: v for k, v in given.items() if v is not None}
    child = _plane(control_plane, token_file).post(f"/v1/grants/{parent}/delegate", {
        "id": id, "principal": to, "authority": authority, "dimensions": dims})
    console.print(f"delegated [bold]{child['id']}[/bold] to {child['principal']} from {parent}")


@grants_app.command("revoke")
def grants_revoke(grant_id: str, reason: str = typer.Option(..., "--reason"),
                  authority: Optional[str] = typer.Option(None, help="Operators: the applied authority that holds it."),
                  control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Revoke a grant and everything delegated from it: new admissions at once, running work within seconds."""
    out = _plane(control_plane, token_file).post(f"/v1/grants/{grant_id}/revoke",
                                                 {"reason": reason, "authority": authority})
    console.print(f"revoked {grant_id}" if out["revoked"] else f"{grant_id} was already revoked")


@grants_app.command("map")
def grants_map(authority: str = typer.Option(..., help="The applied authority to map."),
               dot: Optional[str] = typer.Option(None, help="Write the graph as DOT here (and a PNG beside it where Graphviz is installed)."),
               ledger: Optional[str] = LedgerOpt) -> None:
    """Who really holds execution authority: every grant of an applied authority and below it, through which chain."""
    from aisched_prefect.grants import authority_map, to_dot

    try:
        rows = authority_map(Ledger(ledger), authority)
    except LookupError as exc:
        _fail(str(exc), f"apply it first: aisched apply --authority {authority}")
    console.print(_table("effective authority", [r.model_dump() for r in rows],
                         ["principal", "grant", "chain", "status", "kinds", "models", "gpu_types", "max_gpus",
                          "max_cost_per_run", "expires_at", "can_delegate", "can_approve"]))
    if dot:
        import shutil
        import subprocess

        with open(dot, "w") as f:
            f.write(to_dot(rows))
        console.print(f"graph written to {dot}")
        if shutil.which("dot"):
            png = dot.rsplit(".", 1)[0] + ".png"
            subprocess.run(["dot", "-Tpng", dot, "-o", png], check=True)
            console.print(f"picture written to {png}")


@grants_app.command("list")
def grants_list(ledger: Optional[str] = LedgerOpt) -> None:
    """Delegated grants (from the evidence chain) and whether they are revoked."""
    from aisched_prefect.control.state import AuthorityState

    snap = AuthorityState(Ledger(ledger)).refresh()
    rows = [{**g.model_dump(), "authority": name, "revoked": (name, g.id) in snap.revoked}
            for (name, _), g in snap.delegated.items()]
    console.print(_table("delegated grants", rows, ["authority", "id", "parent", "principal", "kinds", "gpu_types", "max_gpus",
                                                    "max_cost_per_run", "expires_at", "can_delegate", "revoked"]))


@app.command()
def apply(authority: Optional[str] = typer.Option(None, "--authority", help="AuthorityBlock name."),
          budget: Optional[str] = typer.Option(None, "--budget", help="BudgetBlock name."),
          policy: Optional[str] = typer.Option(None, "--policy", help="ApprovalPolicyBlock name."),
          cluster: Optional[str] = typer.Option(None, "--cluster", help="ClusterBlock name."),
          control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Apply blocks as edited in Prefect: from now on they are what the control plane enforces (operators only).

    An edit of a block in the Prefect UI or API does nothing until an operator applies it: a flow that
    rewrites a block through Prefect's API gains nothing.
    """
    from aisched_prefect.control.state import CONFIG_KINDS, block_body

    chosen = {"authority": authority, "budget": budget, "policy": policy, "cluster": cluster}
    if not any(chosen.values()):
        _fail("nothing to apply", "name at least one block: --authority, --budget, --policy or --cluster")
    plane = _plane(control_plane, token_file)
    for kind, name in chosen.items():
        if name is None:
            continue
        try:
            block = CONFIG_KINDS[kind].load(name)
        except ValueError as exc:
            _fail(f"{kind} block {name!r} could not be loaded from Prefect ({exc})", "create it, or check PREFECT_API_URL")
        out = plane.post(f"/v1/config/{kind}/{name}", block_body(block))
        console.print(f"applied {kind} {name!r}: version {out['version']} ({out['digest'][:12]})")


@credentials_app.command("issue")
def credentials_issue(principal: str = typer.Argument(..., help="Who the credential proves, e.g. team-a/nightly."),
                      role: str = typer.Option("flow", help="flow, approver or operator."),
                      tenant: Optional[str] = typer.Option(None, help="Who pays (default: principal up to its '/')."),
                      authority: Optional[str] = typer.Option(None, help="Applied authority it runs under."),
                      budget: Optional[str] = typer.Option(None, help="Applied budget it spends."),
                      policy: Optional[str] = typer.Option(None, help="Applied approval policy."),
                      cluster: Optional[str] = typer.Option(None, help="Applied cluster settings."),
                      out: Optional[str] = typer.Option(None, "--out", help="Write the token here (0600) instead of printing it."),
                      control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Issue a credential (operators only). The token is shown once; the control plane keeps only its hash."""
    body = {"principal": principal, "role": role, "tenant": tenant, "authority": authority, "budget": budget,
            "policy": policy, "cluster": cluster}
    issued = _plane(control_plane, token_file).post("/v1/credentials", body)
    if out:
        from pathlib import Path

        from aisched_prefect.control.keys import write_private

        write_private(Path(out), issued["token"].encode(), force=True)
        console.print(f"credential {issued['credential']['id']} for {principal} written to {out}")
    else:
        typer.echo(issued["token"])


@credentials_app.command("revoke")
def credentials_revoke(credential_id: str, control_plane: Optional[str] = PlaneOpt,
                       token_file: Optional[str] = TokenOpt) -> None:
    """Revoke a credential: its holder is refused from the next request, and its running work is stopped."""
    _plane(control_plane, token_file).post(f"/v1/credentials/{credential_id}/revoke")
    console.print(f"revoked credential {credential_id}")


@app.command()
def workers(as_json: bool = typer.Option(False, "--json"),
            wait: int = typer.Option(0, "--wait", min=0, help="First wait until the control plane answers and this "
                                     "many GPU workers have joined (a script that starts a cluster)."),
            timeout: float = typer.Option(120.0, "--timeout", min=0, help="How long --wait waits, in seconds."),
            control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """The cluster's GPU workers: each device, its type and memory, what is used and by which run, what is free."""
    view = _wait_for_workers(control_plane, token_file, wait, timeout) if wait else \
        _plane(control_plane, token_file).get("/v1/cluster")
    if as_json:
        typer.echo(json.dumps(view, sort_keys=True))
        return
    rows = []
    for w in view["workers"]:
        by_device: dict[str, list[str]] = {}
        for run in w["runs"].values():
            for d in run["devices"]:
                by_device.setdefault(d, []).append(f"{run['task']} ({run.get('principal', '?')})")
        for body in w.get("warm", []):  # idle warm bodies keep their share until their keep-warm time passes
            for d in body["devices"]:
                by_device.setdefault(d, []).append(f"warm body ({body['tenant']}, idle {body['idle']:.0f}s)")
        for d in w["inventory"]["devices"]:
            key = str(d["index"]) if d.get("mig") is None else f"{d['index']}:{d['mig']}"
            used, gb = w["usage"].get(key, (0.0, 0.0))
            rows.append({"worker": w["name"], "device": key, "type": d["gpu_type"], "memory": f"{d['memory_gb']:g} GB",
                         "used": f"{used:.2f} ({gb:g} GB)", "free": f"{1 - used:.2f}", "held by": ", ".join(by_device.get(key, []))})
        if not w["inventory"]["devices"]:
            rows.append({"worker": w["name"], "device": "-", "type": "no GPUs", "memory": "", "used": "", "free": "",
                         "held by": ""})
    console.print(_table(f"GPU workers of {view['dask']}", rows,
                         ["worker", "device", "type", "memory", "used", "free", "held by"]))


def _wait_for_workers(url: Optional[str], token_file: Optional[str], n: int, timeout: float) -> dict:
    """The cluster view once `n` GPU workers are in it; exit 1 naming what is missing after `timeout` seconds.

    A control plane starting on this host writes its operator token first: until then there is none to read.
    """
    from aisched_prefect.client import ControlPlaneUnavailable

    deadline = time.monotonic() + timeout
    view: Optional[dict] = None
    plane = None
    while True:
        try:
            if plane is None and (_token(token_file) is not None or time.monotonic() > deadline):
                plane = _plane(url, token_file)  # past the deadline without a token: fails naming the fix
            if plane is not None:
                view = plane.get("/v1/cluster")
                if len(view["workers"]) >= n:
                    return view
        except ControlPlaneUnavailable:
            pass
        if time.monotonic() > deadline:
            got = "the control plane does not answer" if view is None else \
                f"{len(view['workers'])} joined ({', '.join(w['name'] for w in view['workers']) or 'none'})"
            _fail(f"waited {timeout:g} s for {n} GPU worker(s): {got}",
                  "start them (dask-gpu-worker SCHEDULER --trust-key KEY ...) and read their logs, or wait longer: --timeout")
        time.sleep(0.25)


@app.command()
def doctor(control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt,
           ledger: Optional[str] = LedgerOpt) -> None:
    """Where everything is: the control plane, your credential, the ledger, the Prefect API, the cluster, versions.

    Each line says what was checked and, where something is wrong, the setting to change. Exit 1 if any is wrong.
    """
    import platform
    from importlib.metadata import version as version_of

    import httpx

    from aisched_prefect.settings import settings

    env = settings()
    problems = 0

    def line(what: str, ok: bool, detail: str, fix: str = "") -> None:
        nonlocal problems
        problems += not ok
        console.print(f"{'[green]ok[/green]  ' if ok else '[red]FIX[/red] '} {what}: {detail}" + (f". Fix: {fix}" if fix and not ok else ""))

    versions = ", ".join(f"{p} {version_of(p)}" for p in ("aisched-prefect", "prefect", "distributed", "pydantic"))
    line("versions", True, f"{versions}, Python {platform.python_version()}")
    urls = [control_plane] if control_plane else env.control_plane_urls()
    if not urls:
        line("control plane", True, "none configured (AISCHED_CONTROL_PLANE unset): each flow run starts an embedded one")
    for url in urls:
        try:
            health = httpx.get(f"{url}/v1/health", timeout=5).json()
            line("control plane", True, f"{url} answers (replica {health['replica']}, cluster {health.get('dask')}, "
                 f"key {health['public_key'][:16]}...)")
            if health.get("scheduler", {}).get("connected") is False:
                line("Dask scheduler", False, health.get("error", "it does not answer"),
                     "start the scheduler again: the control plane reconnects by itself")
        except (httpx.HTTPError, ValueError) as exc:
            line("control plane", False, f"{url} does not answer ({type(exc).__name__})",
                 "start it (`aisched serve`) or correct AISCHED_CONTROL_PLANE")
            continue
        try:
            who = _plane(url, token_file).get("/v1/whoami")
            line("credential", True, f"proves {who['role']} {who['principal']!r} (tenant {who['tenant']}, authority "
                 f"{who.get('authority')}, budget {who.get('budget')})")
            if who["role"] == "operator":
                view = _plane(url, token_file).get("/v1/cluster")
                gpus = sum(len(w["inventory"]["devices"]) for w in view["workers"])
                line("cluster", bool(view["workers"]), f"{len(view['workers'])} GPU worker(s), {gpus} device(s) at "
                     f"{view['dask']}", "start GPU workers: dask-gpu-worker ADDRESS --trust-key KEY")
        except (SystemExit, typer.Exit):
            line("credential", False, "none found", "set AISCHED_TOKEN or AISCHED_OPERATOR_TOKEN, or pass --token-file")
        except Exception as exc:
            line("credential", False, str(exc), "ask an operator for a credential: aisched credentials issue")
    url = ledger or env.ledger_url or f"sqlite:///{env.home / 'ledger.db'}"
    from pathlib import Path

    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        line("ledger", True, f"{url} does not exist yet (nothing has run with AISCHED_HOME={env.home})")
        url = ""
    try:
        if not url:
            raise LookupError
        from aisched_prefect.control.state import AuthorityState

        snap = AuthorityState(Ledger(url)).refresh()
        applied = ", ".join(sorted(f"{k} {n} v{a.version}" for (k, n), a in snap.configs.items())) or "nothing applied"
        line("ledger", True, f"{url}: {snap.seq} records up to the last authority record; {applied}")
    except LookupError:
        pass
    except Exception as exc:
        line("ledger", False, f"{url} could not be read ({type(exc).__name__}: {exc})",
             "set AISCHED_LEDGER_URL (or AISCHED_HOME) to the control plane's, or pass --ledger")
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        line("Prefect API", True, "PREFECT_API_URL unset: flow runs start a temporary server each")
    else:
        try:
            httpx.get(f"{api.rstrip('/')}/health", timeout=5).raise_for_status()
            line("Prefect API", True, f"{api} answers")
        except httpx.HTTPError as exc:
            line("Prefect API", False, f"{api} does not answer ({type(exc).__name__})",
                 "start it (`prefect server start`) or correct PREFECT_API_URL")
    if problems:
        raise typer.Exit(1)


@app.command()
def serve(host: str = typer.Option("127.0.0.1", help="Address to listen on."),
          port: int = typer.Option(8790, help="Port (0: any free one)."),
          dask_address: Optional[str] = typer.Option(None, "--dask-address", help="An existing GPU Dask cluster; "
                                                     "default: a local one of this host's GPUs (or --declared)."),
          declared: Optional[str] = typer.Option(None, help="Declared inventory of the local cluster."),
          queue: bool = typer.Option(True, "--queue/--no-queue", help="Every GPU run waits in the cluster's one "
                                     "fair-share queue (the default); --no-queue hands runs to Dask directly."),
          checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir",
                                                       help="Publish signed checkpoints of the evidence here."),
          dask_tls: Optional[str] = typer.Option(None, "--dask-tls", help="TLS files of an existing cluster "
                                                 "(ca.pem, client.pem, client.key; `dask-gpu-scheduler` writes them)."),
          public_url: Optional[str] = typer.Option(None, "--public-url", help="The URL people reach this control "
                                                   "plane at (approval links point there); default: where it listens."),
          print_key: bool = typer.Option(False, "--print-key", help="Print the public key workers trust (made at "
                                         "AISCHED_HOME/control.key on first use) and exit.")) -> None:
    """Run the control plane: the only holder of the ledger, the signing key and the Dask client.

    Prints one JSON line when ready: its URL, its public key (workers of an existing cluster trust it:
    `dask-gpu-worker ... --trust-key KEY`), and on first start where the operator token was written.
    """
    if print_key:  # what workers trust: the raw Ed25519 public key, as dask_gpu.tickets.TicketSigner reads it
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        from aisched_prefect.control.keys import load_or_make_key
        from aisched_prefect.settings import settings

        key = load_or_make_key(settings().home / "control.key")
        typer.echo(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex())
        return
    from aisched_prefect.control.server import serve as run

    run(host=host, port=port, dask_address=dask_address, declared=declared, queue=queue, checkpoint_dir=checkpoint_dir,
        dask_tls=dask_tls, public_url=public_url)


@approvals_app.command("keygen")
def approvals_keygen(out: str = typer.Option(..., help="Private key file to write (PEM); keep it to yourself."),
                     force: bool = ForceOpt) -> None:
    """Make an approver's Ed25519 key; put the printed public key in the AuthorityBlock's approver_keys."""
    public = _write_keypair(out, force)
    console.print(f"wrote {out} (private, 0600) and {out}.pub")
    typer.echo(public)


@approvals_app.command("list")
def approvals_list(as_json: bool = typer.Option(False, "--json"), control_plane: Optional[str] = PlaneOpt,
                   token_file: Optional[str] = TokenOpt) -> None:
    """Runs waiting for a person's approval (from the control plane's records), oldest first."""
    rows = _plane(control_plane, token_file).get("/v1/approvals")
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    now = time.time()
    for r in rows:
        r["id"] = r["id"][:8]  # a unique prefix: approve and reject take it (--json shows whole ids)
        r["left"] = f"{max(r['deadline'] - now, 0):.0f}s"
        r["approvals"] = f"{len(r['approved_by'])}/{r['approvals_required']}"
        r["cost"] = f"{r['est_cost']:.4f} {r['currency']}"
        r["digest"] = r["digest"][:16]
    console.print(_table("waiting for approval", rows, ["id", "task_name", "principal", "rule", "cost", "approvals",
                                                        "left", "status", "digest"]))


@approvals_app.command("link")
def approvals_link(approval_id: str, approver: str = typer.Option(..., "--for", help="The approver the link is for."),
                   control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """A one-time link for one approver to answer one request (operators): hand it to that person alone."""
    typer.echo(_plane(control_plane, token_file).post(f"/v1/approvals/{approval_id}/links", {"approver": approver})["url"])


def _answer(approval_id: str, approve: bool, approver: Optional[str], reason: str, key: Optional[str],
            control_plane: Optional[str], token_file: Optional[str]) -> None:
    from aisched_prefect.approvals import sign_approval

    plane = _plane(control_plane, token_file, signed=key is not None)
    body: dict = {"approve": approve, "approver": approver or "", "reason": reason}
    if key is not None:
        if not approver:
            _fail("a signed answer names its signer", "pass --as NAME (your name in approver_keys)")
        view = plane.get(f"/v1/approvals/{approval_id}") if plane._token else _public_view(plane, approval_id)
        signed_at = time.time()
        body.update(signed_at=signed_at, signature=sign_approval(_load_key(key), view["digest"], approve, approver,
                                                                 reason, signed_at))
    out = plane.post(f"/v1/approvals/{approval_id}/answer", body)
    console.print(f"approved {approval_id}: status {out['status']} (approved by {', '.join(out['approved_by']) or 'nobody yet'})"
                  if approve else f"rejected {approval_id}: the run will not start and its hold is released"
                  if out["status"] == "rejected" else f"your rejection of {approval_id} is recorded (status {out['status']})")


def _public_view(plane: "ControlPlaneClient", approval_id: str) -> dict:
    """What a signed answer signs, without a credential: the request's digest (nothing else about the run)."""
    from aisched_prefect.client import ControlPlaneError

    try:
        return plane.get(f"/v1/approvals/{approval_id}/digest")
    except ControlPlaneError as exc:
        _fail(f"no approval {approval_id} ({exc})", "see `aisched approvals list`")
        raise


def _load_key(path: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    with open(path, "rb") as f:
        key = load_pem_private_key(f.read(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        _fail(f"{path} is not an Ed25519 private key", f"make one: aisched approvals keygen --out {path}")
    return key


ApproverOpt = typer.Option(None, "--as", help="With --key: your name in the authority's approver_keys.")
KeyOpt = typer.Option(None, "--key", help="Your private key from `aisched approvals keygen`: signs the answer.")


@app.command()
def approve(approval_id: str, approver: Optional[str] = ApproverOpt, reason: str = typer.Option("", "--reason"),
            key: Optional[str] = KeyOpt, control_plane: Optional[str] = PlaneOpt,
            token_file: Optional[str] = TokenOpt) -> None:
    """Approve a waiting run (its id from `aisched approvals list`), with your approver token or signed with --key."""
    _answer(approval_id, True, approver, reason, key, control_plane, token_file)


@app.command()
def reject(approval_id: str, approver: Optional[str] = ApproverOpt, reason: str = typer.Option("", "--reason"),
           key: Optional[str] = KeyOpt, control_plane: Optional[str] = PlaneOpt,
           token_file: Optional[str] = TokenOpt) -> None:
    """Reject a waiting run: its hold is released and the task fails with your reason."""
    _answer(approval_id, False, approver, reason, key, control_plane, token_file)


def _flow_names_from_prefect(flow_run_ids: set[str]) -> dict[str, str]:
    """Flow names from the Prefect API, only where one is configured (no temporary server for a report)."""
    from prefect.settings import PREFECT_API_URL

    if not flow_run_ids or not PREFECT_API_URL.value():
        return {}
    from prefect.client.orchestration import get_client

    from aisched_prefect.usage_report import prefect_flow_names

    try:
        with get_client(sync_client=True) as client:
            return prefect_flow_names(client, flow_run_ids)
    except Exception as exc:  # the report stands without names
        typer.echo(f"note: flow names could not be read from the Prefect API ({exc})", err=True)
        return {}


@app.command()
def report(
    by: str = typer.Option("tenant", "--by", help="Group by tenant, principal, flow, model, gpu-type, kind (warm-idle: warm bodies' idle time) or day."),
    since: Optional[str] = typer.Option(None, "--since", help="Runs settled from then on: YYYY-MM-DD or ISO 8601 (UTC)."),
    until: Optional[str] = typer.Option(None, "--until", help="Runs settled before then; a bare date includes that day."),
    flow_run: Optional[str] = typer.Option(None, "--flow-run", help="Only the AI runs of this flow run."),
    csv_out: Optional[str] = typer.Option(None, "--csv", help="One line per run as CSV, to FILE or - (standard output)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines (records: run, group, total, budget) instead of tables."),
    plot: Optional[str] = typer.Option(None, "--plot", help="PNG of cumulative spend per group (needs matplotlib: pip install '.[report]')."),
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """GPU-hours, tokens and money of settled AI runs by group, against every budget; money to the cent."""
    from aisched_prefect.usage_report import (
        InvalidReportOption, PlotUnavailable, budget_table, build_report, check_by, group_table, json_lines,
        parse_when, plot_spend, write_csv,
    )

    try:
        check_by(by)
        start, end = parse_when(since, "--since"), parse_when(until, "--until", end=True)
        book = Ledger(ledger)
        expired = book.expire_holds()  # a hold whose lease ran out is spent money: report it as such
        usage = build_report(book, by=by, since=start, until=end, flow_run_id=flow_run,
                             flow_lookup=_flow_names_from_prefect)
    except InvalidReportOption as exc:
        raise typer.BadParameter(exc.fix, param_hint=f"'{exc.option}' (got {exc.value!r})") from None
    machine = as_json or csv_out == "-"
    if plot:
        try:
            plot_spend(usage.runs, by, plot)
        except PlotUnavailable as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"plot written to {plot}", err=machine)
    if csv_out == "-":
        write_csv(usage.runs, sys.stdout)
        return
    if csv_out:
        with open(csv_out, "w", newline="") as f:
            write_csv(usage.runs, f)
        typer.echo(f"{len(usage.runs)} run(s) written to {csv_out}", err=as_json)
    if as_json:
        for line in json_lines(usage):
            typer.echo(json.dumps(line, sort_keys=True))
        return
    console.print(_table(f"AI usage by {by}", group_table(usage), [by, "runs", "GPU-hours", "tokens", "money", "uncovered"]))
    console.print(_table("budgets" + (" touched" if flow_run else ""), budget_table(usage.budgets),
                         ["budget", "period", "unit", "limit", "posted", "held", "remaining", "used", "in report"]))
    console.print("money: what the ledger posted, in each budget block's currency, rounded to the cent for display")
    if expired:
        console.print(f"{len(expired)} hold(s) whose lease ran out were expired and charged in full")
    for b in usage.mismatches():
        console.print(f"[red]budget {b.budget} ({b.period}): the report's runs add up to {b.in_report}, "
                      f"the ledger posted {b.posted}[/red]")


@app.command()
def queue(as_json: bool = typer.Option(False, "--json", help="The queue's state as one JSON object."),
          control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """The cluster's one queue, as the control plane sees it: runs on GPUs, then waiting runs in serving order."""
    state = _plane(control_plane, token_file).get("/v1/queue")
    if state is None:
        _fail("the control plane's cluster has no queue", "start it with the queue on (`aisched serve`, the default)")
    if as_json:
        typer.echo(json.dumps(state, sort_keys=True))
        return
    now = time.time()
    names = state.get("names") or {}  # address -> the worker's --name (a scheduler older than this CLI: none)

    def named(addresses: list[str]) -> str:
        return ", ".join(names.get(a, a) for a in addresses if a)

    rows = [{"#": i, "state": r["state"], "tenant": r["tenant"], "GPUs": r["gpus"], "priority": r["priority"],
             "preemptible": "yes" if r["preemptible"] else "", "est": f"{r['estimate']:.0f}s",
             "for": f"{now - r['since']:.0f}s", "worker": named(r.get("workers") or [r["worker"] or ""])}
            for i, r in enumerate(state["runs"], 1)]
    console.print(_table(f"queue: {state['running']} running, {state['queued']} waiting", rows,
                         ["#", "state", "tenant", "GPUs", "priority", "preemptible", "est", "for", "worker"]))
    free = ", ".join(f"{names.get(w, w)} {n:g}" for w, n in sorted(state["free"].items(), key=lambda kv: names.get(kv[0], kv[0])))
    weights = ", ".join(f"{t} {w:g}" for t, w in sorted(state["weights"].items())) or "every tenant 1"
    console.print(f"free GPUs: {free or 'no workers'}; tenant weights: {weights}; preempted so far: {state['preempted']}")


def main() -> None:
    """`aisched`: every failure is one line naming the fix (with --debug anywhere, the traceback too)."""
    debug = "--debug" in sys.argv
    if debug:
        sys.argv.remove("--debug")
    try:
        code = app(standalone_mode=False)  # click returns an Exit's code instead of raising it here
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:
        httpx = sys.modules.get("httpx")  # loaded by whichever command talked HTTP; nothing is imported to check
        http_error = httpx is not None and isinstance(exc, httpx.HTTPError)
        if isinstance(exc, (AISchedError, OSError, ValueError)) or http_error:
            if debug:
                raise
            client = sys.modules.get("aisched_prefect.client")
            if client is not None and isinstance(exc, client.ControlPlaneError):
                typer.echo(f"error: the control plane refused (HTTP {exc.status}): {exc}", err=True)
            else:
                typer.echo(f"error: {exc}", err=True)
            sys.exit(2 if http_error or isinstance(exc, OSError) else 1)
        # click's usage errors (typer vendors its own click) print themselves, one line
        show = getattr(exc, "show", None)
        if show is not None and hasattr(exc, "exit_code"):
            show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
