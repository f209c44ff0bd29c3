"""`aisched inventory`, `workers`, `queue` and `doctor`: the GPUs, the cluster's queue, and where everything is."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from aisched_prefect.cli import common
from aisched_prefect.cli.common import LedgerOpt, PlaneOpt, TokenOpt, console


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
        common.fail(str(exc), "correct the spec as the grammar above says", code=2)
    for i, inv in enumerate(invs):
        title = f"worker {i}" if len(invs) > 1 else "devices"
        console.print(f"{title}: source {inv.source}; {inv.describe()}")
        console.print(common.table(title, [d.model_dump() for d in inv.devices], ["index", "uuid", "name", "gpu_type", "memory_gb"]))


def _named(w: dict) -> str:
    """A worker's name, and the Slurm job it runs in (read beside squeue and sacct)."""
    job = w["inventory"].get("slurm_job")
    return f"{w['name']} (Slurm job {job})" if job else w["name"]


def workers(as_json: bool = typer.Option(False, "--json"),
            wait: int = typer.Option(0, "--wait", min=0, help="First wait until the control plane answers and this "
                                     "many GPU workers have joined (a script that starts a cluster)."),
            timeout: float = typer.Option(120.0, "--timeout", min=0, help="How long --wait waits, in seconds."),
            control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """The cluster's GPU workers: each device, its type and memory, what is used and by which run, what is free."""
    view = _wait_for_workers(control_plane, token_file, wait, timeout) if wait else \
        common.plane(control_plane, token_file).get("/v1/cluster")
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
            rows.append({"worker": _named(w), "device": key, "type": d["gpu_type"], "memory": f"{d['memory_gb']:g} GB",
                         "used": f"{used:.2f} ({gb:g} GB)", "free": f"{1 - used:.2f}", "held by": ", ".join(by_device.get(key, []))})
        if not w["inventory"]["devices"]:
            rows.append({"worker": _named(w), "device": "-", "type": "no GPUs", "memory": "", "used": "", "free": "",
                         "held by": ""})
    console.print(common.table(f"GPU workers of {view['dask']}", rows,
                               ["worker", "device", "type", "memory", "used", "free", "held by"]))


def _wait_for_workers(url: Optional[str], token_file: Optional[str], n: int, timeout: float) -> dict:
    """The cluster view once `n` GPU workers are in it; exit 1 naming what is missing after `timeout` seconds.

    A control plane starting on this host writes its operator token first: until then there is none to read.
    """
    from aisched_prefect.flow.client import ControlPlaneUnavailable

    deadline = time.monotonic() + timeout
    view: Optional[dict] = None
    plane = None
    while True:
        try:
            if plane is None and (common.token(token_file) is not None or time.monotonic() > deadline):
                plane = common.plane(url, token_file)  # past the deadline without a token: fails naming the fix
            if plane is not None:
                view = plane.get("/v1/cluster")
                if len(view["workers"]) >= n:
                    return view
        except ControlPlaneUnavailable:
            pass
        if time.monotonic() > deadline:
            got = "the control plane does not answer" if view is None else \
                f"{len(view['workers'])} joined ({', '.join(w['name'] for w in view['workers']) or 'none'})"
            common.fail(f"waited {timeout:g} s for {n} GPU worker(s): {got}",
                        "start them (dask-gpu-worker SCHEDULER --trust-key KEY ...) and read their logs, or wait longer: --timeout")
        time.sleep(0.25)


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
            who = common.plane(url, token_file).get("/v1/whoami")
            line("credential", True, f"proves {who['role']} {who['principal']!r} (tenant {who['tenant']}, authority "
                 f"{who.get('authority')}, budget {who.get('budget')})")
            if who["role"] == "operator":
                view = common.plane(url, token_file).get("/v1/cluster")
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
        from aisched_prefect.control.authority.state import AuthorityState

        snap = AuthorityState(common.Ledger(url)).refresh()
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


def queue(as_json: bool = typer.Option(False, "--json", help="The queue's state as one JSON object."),
          control_plane: Optional[str] = PlaneOpt, token_file: Optional[str] = TokenOpt) -> None:
    """The cluster's one queue, as the control plane sees it: runs on GPUs, then waiting runs in serving order."""
    state = common.plane(control_plane, token_file).get("/v1/queue")
    if state is None:
        common.fail("the control plane's cluster has no queue", "start it with the queue on (`aisched serve`, the default)")
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
    console.print(common.table(f"queue: {state['running']} running, {state['queued']} waiting", rows,
                               ["#", "state", "tenant", "GPUs", "priority", "preemptible", "est", "for", "worker"]))
    free = ", ".join(f"{names.get(w, w)} {n:g}" for w, n in sorted(state["free"].items(), key=lambda kv: names.get(kv[0], kv[0])))
    weights = ", ".join(f"{t} {w:g}" for t, w in sorted(state["weights"].items())) or "every tenant 1"
    console.print(f"free GPUs: {free or 'no workers'}; tenant weights: {weights}; preempted so far: {state['preempted']}")
