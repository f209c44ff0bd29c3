"""`aisched evidence` (checkpoint, verify, show, export) and `aisched explain`: the hash-chained evidence log."""

from __future__ import annotations

from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import LedgerOpt, PlaneOpt, TokenOpt, console


evidence_app = typer.Typer(help="The hash-chained evidence log.", no_args_is_help=True)


@evidence_app.command("checkpoint")
def evidence_checkpoint(control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """Have the control plane sign the head of the log and publish it outside the database (run it on a schedule)."""
    cp = common.plane(control_plane, token_file).post("/v1/checkpoints")
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
    book = common.Ledger(ledger)
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
        common.fail("--checkpoint needs the control plane's key to check the signature against",
                    "pass --public-key (what `aisched serve` printed), or --control-plane URL to ask it")
    return bytes.fromhex(httpx.get(f"{urls[0]}/v1/health", timeout=10).json()["public_key"])


@evidence_app.command("show")
def evidence_show(flow_run: Optional[str] = typer.Option(None, help="Only this flow run's task runs."),
                  limit: int = typer.Option(200, "--limit", min=0,
                                            help="Show the last N rows of each table (0: all of them)."),
                  ledger: Optional[str] = LedgerOpt) -> None:
    """One row per attempt of each AI task run (request, principal, grant, worker, reserved, charged, decision),
    then the operators' records apart: credentials, applied configuration, grants."""
    from aisched_prefect.reports.runs import MONEY_NOTE, evidence_rows, for_display, operator_rows

    def last(rows: list, what: str) -> list:
        if limit and len(rows) > limit:
            console.print(f"{what}: the last {limit} of {len(rows)} rows (--limit 0 shows all, --flow-run ID one run)")
            return rows[-limit:]
        return rows

    records = common.Ledger(ledger).records(flow_run)
    rows = last([for_display(r) for r in evidence_rows(records)], "AI task runs")
    console.print(common.table("AI task runs", rows, ["task", "attempt", "principal", "request", "grant", "worker", "devices",
                                                      "reserved", "charged", "decision"]))
    console.print(MONEY_NOTE)
    operated = last(operator_rows(records), "operators' records") if flow_run is None else []
    if operated:
        console.print(common.table("operators' records (credentials, configuration, grants)", operated,
                                   ["record", "kind", "by", "what"]))


FIRST = 10  # task runs shown in detail (and runs in the table) unless --all


def explain(run_id: str = typer.Argument(..., help="A flow-run or task-run id."), ledger: Optional[str] = LedgerOpt,
            all_: bool = typer.Option(False, "--all", help="Every run and every record, not the first "
                                      f"{FIRST} task runs.")) -> None:
    """Why that run was allowed or denied, under which grant chain, approved by whom, at what cost. A flow run of
    several runs (a map) is summed up first: per task its shards, cold and warm starts, bodies, idle time and
    charge per body; then its warm bodies and its first runs (each cold or warm, and which body)."""
    from aisched_prefect.reports.runs import explain as explain_records
    from aisched_prefect.reports.run_summary import body_rows, run_rows, task_rows

    book = common.Ledger(ledger)
    records = book.records_about(run_id)
    if not records:
        common.fail(f"no evidence records for {run_id} in {book.url}",
                    "point at the control plane's ledger: AISCHED_LEDGER_URL, AISCHED_HOME, or --ledger")
    task_runs = list(dict.fromkeys(r.task_run_id for r in records if r.task_run_id
                                   and not r.task_run_id.startswith("warm-")))
    runs, bodies = run_rows(records), body_rows(records)
    if len(task_runs) > 1 or bodies:
        console.print(common.table(f"{run_id}: {len(task_runs)} task run(s)", task_rows(records),
                                   ["task", "shards", "cold starts", "warm starts", "fresh processes", "bodies",
                                    "run s", "charged", "idle s per body", "idle charged per body", "idle share"]))
        if bodies:
            shown = bodies if all_ else bodies[:FIRST]
            console.print(common.table(f"warm bodies ({len(shown)} of {len(bodies)})", [
                {**b, "idle s": f"{b['idle s']:.1f}", "idle charged": f"{b['idle charged']:.6f}"} for b in shown],
                ["body", "task", "runs", "cold", "idle periods", "idle s", "idle charged", "ended"]))
        shown_runs = runs if all_ else runs[:FIRST]
        console.print(common.table(f"runs ({len(shown_runs)} of {len(runs)}; money on the first account)", shown_runs,
                                   ["record", "task run", "task", "outcome", "start", "body", "body run", "idle before",
                                    "worker", "seconds", "charged"]))
    keep = set(task_runs if all_ else task_runs[:FIRST])
    detail = [r for r in records if all_ or not r.task_run_id or r.task_run_id in keep
              or (r.task_run_id.startswith("warm-") and len(task_runs) <= FIRST)]
    typer.echo(explain_records(detail))
    if not all_ and len(task_runs) > FIRST:
        typer.echo(f"... {len(task_runs) - FIRST} more task runs, and their warm bodies' idle records: "
                   f"aisched explain {run_id} --all prints every record")


@evidence_app.command("export")
def evidence_export(out: Optional[str] = typer.Option(None, help="File to write (default: standard output)."),
                    ledger: Optional[str] = LedgerOpt) -> None:
    """Every record as JSON lines (schema aisched.evidence/1), in chain order."""
    import json
    import sys

    from aisched_prefect.reports.runs import export_line

    stream = open(out, "w") if out else sys.stdout
    try:
        for record in common.Ledger(ledger).records():
            stream.write(json.dumps(export_line(record), sort_keys=True) + "\n")
    finally:
        if out:
            stream.close()
