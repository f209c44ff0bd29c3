"""The `aisched` command line: inspect inventory, budgets and evidence."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from aisched_prefect.errors import AISchedError
from aisched_prefect.ledger import Ledger
from aisched_prefect.report import evidence_rows

app = typer.Typer(help="aisched-prefect: GPU inventory, budgets and the evidence log.", no_args_is_help=True)
evidence_app = typer.Typer(help="The hash-chained evidence log.", no_args_is_help=True)
budget_app = typer.Typer(help="Budget accounts in the ledger.", no_args_is_help=True)
app.add_typer(evidence_app, name="evidence")
app.add_typer(budget_app, name="budget")
grants_app = typer.Typer(help="Delegate, revoke and list grants.", no_args_is_help=True)
app.add_typer(grants_app, name="grants")
approvals_app = typer.Typer(help="Runs waiting for a person, and approvers' keys.", no_args_is_help=True)
app.add_typer(approvals_app, name="approvals")
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)  # piped output: no 80-column squeeze

LedgerOpt = typer.Option(None, "--ledger", help="Ledger URL (default: AISCHED_LEDGER_URL or ~/.aisched/ledger.db).")


def _table(title: str, rows: list[dict], columns: list[str]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, overflow="fold")  # a narrow terminal wraps values, never cuts them
    for r in rows:
        table.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in columns))
    return table


@app.command()
def inventory(declared: Optional[str] = typer.Option(None, help="Declared inventory, e.g. '2 GPUs, 80 GB, H100'.")) -> None:
    """Show the GPUs this host would advertise as a Dask worker."""
    from dask_gpu import discover

    inv = discover(declared)
    console.print(f"source: {inv.source}; {inv.describe()}")
    console.print(_table("devices", [d.model_dump() for d in inv.devices], ["index", "uuid", "name", "gpu_type", "memory_gb"]))


def _write_keypair(out: str) -> str:
    """A new Ed25519 key: private half (PEM) to OUT, public half (PEM) to OUT.pub; returns the public key in hex."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    key = Ed25519PrivateKey.generate()
    with open(out, "wb") as f:
        f.write(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    with open(out + ".pub", "wb") as f:
        f.write(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


@evidence_app.command("keygen")
def evidence_keygen(out: str = typer.Option(..., help="Private key file to write (PEM); OUT.pub gets the public key.")) -> None:
    """Make an Ed25519 key pair for signing checkpoints of the evidence chain; keep the private half apart."""
    _write_keypair(out)
    console.print(f"wrote {out} and {out}.pub")


@evidence_app.command("checkpoint")
def evidence_checkpoint(key: str = typer.Option(..., help="Private key (PEM) from `aisched evidence keygen`."),
                        ledger: Optional[str] = LedgerOpt) -> None:
    """Sign the current head of the evidence chain (run it on a schedule, e.g. hourly)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    with open(key, "rb") as f:
        private = load_pem_private_key(f.read(), password=None)
    cp = Ledger(ledger).checkpoint(private)  # type: ignore[arg-type]
    console.print(f"signed checkpoint at record {cp.seq} ({cp.hash[:16]}...)")


def _public_key(path: Optional[str]) -> Optional[bytes]:
    if path is None:
        return None
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

    with open(path, "rb") as f:
        return load_pem_public_key(f.read()).public_bytes(Encoding.Raw, PublicFormat.Raw)


@evidence_app.command("verify")
def evidence_verify(ledger: Optional[str] = LedgerOpt,
                    public_key: Optional[str] = typer.Option(None, "--public-key", help="Also check signed checkpoints with this public key (PEM).")) -> None:
    """Check the whole chain; exit 1 on any edit, deletion, reordering or truncation, naming the record."""
    report = Ledger(ledger).verify(_public_key(public_key))
    if report.ok:
        console.print(f"[green]evidence chain intact[/green]: {report.records} records")
        return
    console.print(f"[red]evidence chain broken[/red] at record {report.at_seq}: {report.problem}")
    raise typer.Exit(1)


@evidence_app.command("show")
def evidence_show(flow_run: Optional[str] = typer.Option(None, help="Only this flow run's task runs."),
                  ledger: Optional[str] = LedgerOpt) -> None:
    """One row per AI task run: request, principal, grant, placement, reserved, charged, decision."""
    rows = evidence_rows(Ledger(ledger).records(flow_run))
    console.print(_table("AI task runs", rows, ["task", "principal", "request", "grant", "worker", "devices",
                                                "reserved", "charged", "decision"]))


@app.command()
def explain(run_id: str = typer.Argument(..., help="A flow-run or task-run id."), ledger: Optional[str] = LedgerOpt) -> None:
    """Why that run was allowed or denied, under which grant chain, approved by whom, at what cost."""
    from aisched_prefect.report import explain as explain_records

    records = Ledger(ledger).records_about(run_id)
    typer.echo(explain_records(records))
    if not records:
        raise typer.Exit(1)


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
    principal: str = typer.Option(..., help="Principal or glob, e.g. team-a/*."),
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
    """Add a root grant to an AuthorityBlock, as the Prefect UI's block editor would (needs the Prefect API)."""
    from blocks import AuthorityBlock, Grant

    try:
        block = AuthorityBlock.load(authority)
    except ValueError:
        block = AuthorityBlock()
    if any(g.id == id for g in block.grants):
        console.print(f"[red]AuthorityBlock {authority!r} already has a grant {id!r}: choose another --id[/red]")
        raise typer.Exit(1)
    grant = Grant(id=id, principal=principal, kinds=_names(kinds) or ["*"], models=_names(models) or ["*"],
                  gpu_types=_names(gpu_types) or ["*"], max_gpus=max_gpus, max_cost_per_run=max_cost,
                  max_priority=max_priority, expires_at=expires, can_delegate=can_delegate, can_approve=can_approve)
    AuthorityBlock(grants=[*block.grants, grant]).save(authority, overwrite=True)
    console.print(f"added root grant [bold]{id}[/bold] for {principal} to AuthorityBlock {authority!r}")


@grants_app.command("delegate")
def grants_delegate(
    parent: str = typer.Argument(..., help="Id of the grant to delegate from."),
    id: str = typer.Option(..., "--id", help="Id of the new grant."),
    to: str = typer.Option(..., "--to", help="Principal that receives it, e.g. team-a/nightly."),
    by: str = typer.Option(..., "--by", help="Who delegates (recorded in the evidence)."),
    authority: str = typer.Option(..., help="AuthorityBlock at the root of the parent's chain (needs the Prefect API)."),
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
    ledger: Optional[str] = LedgerOpt,
) -> None:
    """Delegate a narrower grant; anything wider than the parent is refused, naming the dimension."""
    from aisched_prefect.grants import delegate_grant
    from blocks import ChainBroken, DelegationRefused

    given = {"kinds": _names(kinds), "models": _names(models), "gpu_types": _names(gpu_types), "max_gpus": max_gpus,
             "max_cost_per_run": max_cost, "budget_share": budget_share, "max_priority": max_priority,
             "expires_at": expires}
    dims = {k: v for k, v in given.items() if v is not None}
    try:
        child = delegate_grant(parent, id=id, principal=to, by=by, authority=authority, ledger=Ledger(ledger),
                               can_delegate=can_delegate, can_approve=can_approve, **dims)
    except (DelegationRefused, ChainBroken) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1)
    console.print(f"delegated [bold]{child.id}[/bold] to {child.principal} from {parent}")


@grants_app.command("revoke")
def grants_revoke(grant_id: str, by: str = typer.Option(..., "--by"), reason: str = typer.Option(..., "--reason"),
                  ledger: Optional[str] = LedgerOpt) -> None:
    """Revoke a grant and everything delegated from it, from the next admission on."""
    from aisched_prefect.grants import revoke_grant

    first = revoke_grant(grant_id, by=by, reason=reason, ledger=Ledger(ledger))
    console.print(f"revoked {grant_id}" if first else f"{grant_id} was already revoked")


@grants_app.command("map")
def grants_map(authority: str = typer.Option(..., help="AuthorityBlock with the root grants (needs the Prefect API)."),
               dot: Optional[str] = typer.Option(None, help="Write the graph as DOT here (and a PNG beside it where Graphviz is installed)."),
               ledger: Optional[str] = LedgerOpt) -> None:
    """Who really holds execution authority: every principal's effective grants, through which chain."""
    from aisched_prefect.grants import authority_map, to_dot

    store = Ledger(ledger)
    rows = authority_map(authority, store)
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
    """Delegated grants in the ledger and whether they are revoked."""
    store = Ledger(ledger)
    revoked = store.revoked_ids()
    rows = [{**g.model_dump(), "revoked": g.id in revoked} for g in store.delegated_grants().values()]
    console.print(_table("delegated grants", rows, ["id", "parent", "principal", "kinds", "gpu_types", "max_gpus",
                                                    "max_cost_per_run", "expires_at", "can_delegate", "revoked"]))


@approvals_app.command("keygen")
def approvals_keygen(out: str = typer.Option(..., help="Private key file to write (PEM); keep it to yourself.")) -> None:
    """Make an approver's Ed25519 key; put the printed public key in the AuthorityBlock's approver_keys."""
    public = _write_keypair(out)
    console.print(f"wrote {out} (private) and {out}.pub")
    typer.echo(public)


@approvals_app.command("list")
def approvals_list(as_json: bool = typer.Option(False, "--json"), ledger: Optional[str] = LedgerOpt) -> None:
    """Runs waiting for a person's approval, oldest first."""
    from aisched_prefect.approval_channel import pending

    rows = [a.model_dump() for a in pending(Ledger(ledger))]
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, sort_keys=True))
        return
    for r in rows:
        r["waiting"] = f"{time.time() - r['asked_at']:.0f}s"
        r["approvals"] = f"{len(r['votes'])}/{r['approvals_required']}"
        r["runs"] = len(r["items"]) or 1
    console.print(_table("waiting for approval", rows, ["task_run_id", "task", "runs", "principal", "rule", "est_cost",
                                                        "approvals", "waiting", "flow_run_id"]))


def _answer(task_run_id: str, approve: bool, approver: str, reason: str, key: Optional[str], ledger: Optional[str]) -> None:
    from aisched_prefect.approval_channel import answer, load_key

    try:
        answer(Ledger(ledger), task_run_id, approve=approve, approver=approver, reason=reason,
               key=load_key(key) if key else None)
    except AISchedError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    console.print(f"{'approved' if approve else 'rejected'} {task_run_id} as {approver}"
                  + (" (signed)" if key else " (unsigned: counts only for approvers without a key)"))


ApproverOpt = typer.Option(..., "--as", help="Your approver name (must hold a grant with can_approve).")
KeyOpt = typer.Option(None, "--key", help="Your private key from `aisched approvals keygen`: signs the answer.")


@app.command()
def approve(task_run_id: str, approver: str = ApproverOpt, reason: str = typer.Option("", "--reason"),
            key: Optional[str] = KeyOpt, ledger: Optional[str] = LedgerOpt) -> None:
    """Approve a waiting run (id or a unique prefix, from `aisched approvals list`)."""
    _answer(task_run_id, True, approver, reason, key, ledger)


@app.command()
def reject(task_run_id: str, approver: str = ApproverOpt, reason: str = typer.Option("", "--reason"),
           key: Optional[str] = KeyOpt, ledger: Optional[str] = LedgerOpt) -> None:
    """Reject a waiting run: its hold is released and the task fails with your reason."""
    _answer(task_run_id, False, approver, reason, key, ledger)


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
    by: str = typer.Option("tenant", "--by", help="Group by tenant, principal, flow, model, gpu-type or day."),
    since: Optional[str] = typer.Option(None, "--since", help="Runs settled from then on: YYYY-MM-DD or ISO 8601 (UTC)."),
    until: Optional[str] = typer.Option(None, "--until", help="Runs settled before then; a bare date includes that day."),
    flow_run: Optional[str] = typer.Option(None, "--flow-run", help="Only the AI runs of this flow run."),
    csv_out: Optional[str] = typer.Option(None, "--csv", help="One line per run as CSV, to FILE or - (standard output)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines (records: run, group, total, budget) instead of tables."),
    plot: Optional[str] = typer.Option(None, "--plot", help="PNG of cumulative spend per group (needs matplotlib: the bench extra)."),
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
def queue(
    address: str = typer.Option(..., "--address", envvar="AISCHED_DASK_ADDRESS",
                                help="The shared Dask scheduler, e.g. tcp://10.0.0.5:8786 (or AISCHED_DASK_ADDRESS)."),
    as_json: bool = typer.Option(False, "--json", help="The queue's state as one JSON object."),
) -> None:
    """The cluster's one queue (AISchedTaskRunner(queue=True)): runs on GPUs, then waiting runs in serving order."""
    from distributed import Client

    try:
        client = Client(address, timeout="10s", set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise typer.BadParameter(f"no Dask scheduler answered there ({exc}); pass the address a runner's "
                                 "address= names, e.g. tcp://host:8786", param_hint="'--address'") from None
    try:
        state = client.sync(client.scheduler.gpu_queue_status, runs=True)  # None: the scheduler has no such handler
    finally:
        client.close()
    if state is None:
        typer.echo(f"no queue on the cluster at {address} yet: the first flow run with "
                   "AISchedTaskRunner(queue=True) installs it", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(state, sort_keys=True))
        return
    now = time.time()
    rows = [{"#": i, "state": r["state"], "tenant": r["tenant"], "GPUs": r["gpus"], "priority": r["priority"],
             "preemptible": "yes" if r["preemptible"] else "", "est": f"{r['estimate']:.0f}s",
             "for": f"{now - r['since']:.0f}s", "worker": r["worker"]} for i, r in enumerate(state["runs"], 1)]
    console.print(_table(f"queue at {address}: {state['running']} running, {state['queued']} waiting", rows,
                         ["#", "state", "tenant", "GPUs", "priority", "preemptible", "est", "for", "worker"]))
    free = ", ".join(f"{w} {n}" for w, n in state["free"].items())
    weights = ", ".join(f"{t} {w:g}" for t, w in sorted(state["weights"].items())) or "every tenant 1"
    console.print(f"free GPUs: {free or 'no workers'}; tenant weights: {weights}; preempted so far: {state['preempted']}")


if __name__ == "__main__":  # pragma: no cover
    app()
