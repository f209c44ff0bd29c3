"""bench/faults.py's restart scenarios (issue 31): the plane killed and started again, the ledger's Postgres
restarted, the Dask scheduler down, each under a map of `--restart-runs` runs (1,000 by default).

Each scenario runs on a cluster of separate processes (tests.clusterprocs: a scheduler, two workers declared
"2 GPUs, 80 GB, H100" each, quarter-GPU runs, 16 at once) and its own control plane, and prints, per scenario:
runs completed, failed by reason, and money charged for runs that never ran (goal 0): charged by a settlement
of a run whose body never started (its marks file says which started), by a hold that expired, or still held
(pending: it would expire charged in full). Bodies are not kept warm (keep_warm=0): no idle holds.

1. plane-restart-Ds: SIGKILL the plane D s after every run of the map was admitted, start it again on its address.
2. ledger-restart: the plane's Postgres behind a TCP proxy that drops every connection and refuses new ones for
   `--ledger-down` s (a restart) while runs finish. Needs `--postgres URL`.
3. scheduler-down: the scheduler (and its workers) killed for `--scheduler-down` s under the map; /v1/health must
   be green within 5 s of its return, and a call made meanwhile refused with a record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PRINCIPAL = "bench/restarts"
DECLARED = "2 GPUs, 80 GB, H100"

FLOW_SCRIPT = '''
import json, os, sys, time
from prefect import flow, unmapped
from prefect.context import FlowRunContext
from aisched_prefect import AISchedTaskRunner, ai_task

url, token, n, marks, out, seconds = sys.argv[1:7]


def mark(what):
    fd = os.open(marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, what.encode())
    finally:
        os.close(fd)


@ai_task(gpus=0.25, kind="inference", est_seconds=60, keep_warm=0, name="shard")
def shard(i, seconds):
    mark(f"start {i}\\n")
    time.sleep(seconds)
    mark(f"end {i}\\n")
    return i


@flow(task_runner=AISchedTaskRunner(control_plane=url, credential=token), name="restarts-bench")
def restarts(n: int) -> list:
    print(FlowRunContext.get().flow_run.id, flush=True)
    futures = shard.map(range(n), seconds=unmapped(float(seconds)))
    futures.wait()
    ended = []
    for f in futures:
        state = f.state
        if state.is_completed():
            ended.append(["completed", f.result()])
        else:
            exc = f.result(raise_on_failure=False)
            said = str(exc).split(":", 1)[0]  # a plane's error the flow could not unpickle: "module.Name: ..."
            named = said.rsplit(".", 1)[-1] if "." in said and " " not in said else type(exc).__name__
            ended.append(["failed", named if isinstance(exc, BaseException) else str(state.type)])
    return ended


with open(out, "w") as f:
    json.dump(restarts(int(n)), f)
'''


def _held(ledger: Any, flow_run_id: str) -> float:
    """What the flow run's runs still hold (pending holds: each would expire charged in full)."""
    import sqlalchemy as sa

    from aisched_prefect.ledger import holds

    with ledger.engine.connect() as conn:
        micros = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(holds.c.reserved_micros), 0)).where(
            (holds.c.flow_run_id == flow_run_id) & (holds.c.status == "pending"))).scalar()
    return int(micros) / 1e6


class RestartFaults:
    """One cluster of processes per scenario; `report` rows: (scenario, completed, failed by reason, never-ran money,
    seconds, notes)."""

    def __init__(self, args: Any, work: Path) -> None:
        self.args, self.work = args, work
        self.rows: list[tuple[str, int, dict[str, int], float, float, str]] = []
        self.broken: list[str] = []  # scenarios whose evidence chain did not verify

    # -- the parts ----------------------------------------------------------------------------------
    def _cluster(self, name: str, env: dict[str, str] | None = None) -> Any:
        from tests.clusterprocs import ClusterProcs

        root = self.work / name
        root.mkdir()
        procs = ClusterProcs(root, env={"DASK_DASK_GPU__ISOLATION__MODE": "shared",
                                        "PREFECT_API_URL": os.environ["PREFECT_API_URL"], **(env or {})})
        procs.start_scheduler()
        for w in ("gpu-a", "gpu-b"):
            procs.start_worker(w, DECLARED)
        procs.wait_for_workers(2, timeout=120)
        procs.start_plane()
        return procs

    def _tenant(self, plane: Any, name: str) -> str:
        from blocks import AuthorityBlock, BudgetBlock, Grant

        plane.apply("authority", name, AuthorityBlock(grants=[Grant(
            id=name, principal=PRINCIPAL, kinds=["inference"], max_gpus=1, max_cost_per_run=1.0)]))
        plane.apply("budget", name, BudgetBlock(limit=1_000_000, gpu_hour_prices={"*": 1.0}))
        return plane.issue(PRINCIPAL, authority=name, budget=name)

    def _flow(self, name: str, url: str, token: str) -> tuple[subprocess.Popen, Path, Path, str]:
        script, marks, out = (self.work / f"{name}.{x}" for x in ("py", "marks", "json"))
        script.write_text(FLOW_SCRIPT)
        marks.touch()
        os.chmod(marks, 0o666)
        env = {**os.environ, "PREFECT_LOGGING_LEVEL": "ERROR",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, str(script), url, token, str(self.args.restart_runs), str(marks),
                                 str(out), str(self.args.body_seconds)], stdout=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        flow_run_id = (proc.stdout.readline() if proc.stdout else "").strip()
        if not flow_run_id:
            raise SystemExit(f"the {name} flow process did not start (exit {proc.wait()})")
        return proc, marks, out, flow_run_id

    @staticmethod
    def _until(check: Any, timeout: float, every: float = 0.25) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(every)
        return None

    def _admitted(self, ledger: Any, flow_run_id: str) -> int:
        return sum(r.kind == "admission" for r in ledger.records(flow_run_id))

    def _finish(self, name: str, proc: subprocess.Popen, out: Path, marks: Path, ledger: Any, flow_run_id: str,
                budget: str, t0: float, notes: str = "") -> None:
        try:
            proc.wait(self.args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            notes += f"; the flow was still waiting after {self.args.timeout:g} s (killed)"
        wall = time.monotonic() - t0
        ended = json.loads(out.read_text()) if out.exists() else []
        completed = sum(1 for e in ended if e[0] == "completed")
        failed = Counter(e[1] for e in ended if e[0] != "completed")
        if len(ended) < self.args.restart_runs:
            failed["never ended (flow hung or died)"] += self.args.restart_runs - len(ended)
        records = ledger.records(flow_run_id)
        started = {int(line.split()[1]) for line in marks.read_text().splitlines() if line.startswith("start ")}
        settled = [r for r in records if r.kind == "settlement"]
        no_body = sum(sum(s.get("charged", 0.0) for s in r.payload.get("settlements", [])) for r in settled
                      if not (r.payload.get("placement") or {}).get("worker") and not r.payload.get("seconds"))
        expired = sum(sum(s.get("charged", 0.0) for s in r.payload.get("settlements", [])) for r in records
                      if r.kind == "hold-expired")
        pending = _held(ledger, flow_run_id)
        twice = sum(1 for c in Counter(r.task_run_id for r in settled).values() if c > 1)
        never = no_body + expired + pending
        chain = ledger.verify()
        if not chain.ok:
            self.broken.append(name)
        notes += (f"; bodies started {len(started)}, settlements {len(settled)} ({twice} runs settled twice), "
                  f"outcomes {dict(Counter(r.payload.get('outcome') for r in settled))}; never-ran money = "
                  f"{no_body:.4f} settled + {expired:.4f} expired + {pending:.4f} still held; evidence chain "
                  f"{'verifies' if chain.ok else 'BROKEN'}")
        self.rows.append((name, completed, dict(failed), never, wall, notes.lstrip("; ")))
        print(f"  {name}: completed {completed}, failed {dict(failed)}, charged for runs that never ran "
              f"{never:.4f} USD, {wall:.1f} s ({notes.lstrip('; ')})", flush=True)

    # -- 1 ------------------------------------------------------------------------------------------
    def plane_restart(self, delay: float) -> None:
        name = f"plane-restart-{delay:g}s"
        print(f"\n{name}: the plane killed {delay:g} s after a {self.args.restart_runs}-run map was admitted, "
              "then started again on its address", flush=True)
        procs = self._cluster(name)
        try:
            plane = procs.plane
            token = self._tenant(plane, name)
            t0 = time.monotonic()
            proc, marks, out, flow_run_id = self._flow(name, plane.url, token)
            ledger = plane.ledger()
            got = self._until(lambda: self._admitted(ledger, flow_run_id) >= self.args.restart_runs, self.args.timeout)
            notes = f"map admitted in {time.monotonic() - t0:.1f} s" if got else "the map was never all admitted"
            time.sleep(delay)
            port = plane.url.rsplit(":", 1)[1]
            plane.kill()
            plane.args[plane.args.index("--port") + 1] = port
            plane.start()
            self._finish(name, proc, out, marks, ledger, flow_run_id, name, t0, notes)
        finally:
            procs.close()

    # -- 2 ------------------------------------------------------------------------------------------
    def ledger_restart(self) -> None:
        from tests.helpers import CuttingProxy

        name = "ledger-restart"
        url = self.args.postgres
        print(f"\n{name}: Postgres gone for {self.args.ledger_down:g} s while runs finish", flush=True)
        import sqlalchemy as sa

        schema = f"bench_{int(time.time())}"
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
        scoped = f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
        host_port = url.split("@", 1)[1].split("/", 1)[0]
        proxy = CuttingProxy(host_port)
        procs = self._cluster(name, env={"AISCHED_LEDGER_URL": scoped.replace(host_port, proxy.url[7:], 1)})
        try:
            from aisched_prefect import Ledger

            plane, auditor = procs.plane, Ledger(scoped)
            token = self._tenant(plane, name)
            t0 = time.monotonic()
            proc, marks, out, flow_run_id = self._flow(name, plane.url, token)
            half = self.args.restart_runs // 2
            self._until(lambda: marks.read_text().count("end ") >= half, self.args.timeout)
            proxy.down(self.args.ledger_down)
            notes = f"Postgres down at {time.monotonic() - t0:.1f} s, after {half} runs ended"
            self._finish(name, proc, out, marks, auditor, flow_run_id, name, t0, notes)
            auditor.close()
        finally:
            procs.close()
            proxy.close()
            with engine.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
            engine.dispose()

    # -- 3 ------------------------------------------------------------------------------------------
    def scheduler_down(self) -> None:
        name = "scheduler-down"
        down = self.args.scheduler_down
        print(f"\n{name}: the scheduler and its workers gone for {down:g} s under the map", flush=True)
        procs = self._cluster(name)
        try:
            plane = procs.plane
            token = self._tenant(plane, name)
            port = int(procs.address.rsplit(":", 1)[1])
            t0 = time.monotonic()
            proc, marks, out, flow_run_id = self._flow(name, plane.url, token)
            ledger = plane.ledger()
            self._until(lambda: marks.read_text().count("start ") >= 16, self.args.timeout)
            for p in ("scheduler", "gpu-a", "gpu-b"):
                os.killpg(procs.procs[p].pid, signal.SIGKILL)
                procs.procs[p].wait()
            lost = time.monotonic()
            self._until(lambda: plane.request("GET", "/v1/health", token="").status_code == 503, 60)
            time.sleep(max(0.0, down - (time.monotonic() - lost)))
            procs.start_scheduler(port)
            back = time.monotonic()
            green = self._until(lambda: plane.request("GET", "/v1/health", token="").status_code == 200, 60, 0.1)
            to_green = time.monotonic() - back
            for w in ("gpu-a", "gpu-b"):
                procs.start_worker(w, DECLARED)
            notes = (f"health green {to_green:.1f} s after the scheduler was back" if green
                     else "health NOT green within 60 s of the scheduler's return")
            self._finish(name, proc, out, marks, ledger, flow_run_id, name, t0, notes)
        finally:
            procs.close()

    def run(self) -> None:
        for delay in self.args.restart_delays:
            self.plane_restart(delay)
        if self.args.postgres:
            self.ledger_restart()
        else:
            print("\nledger-restart: skipped (no --postgres URL)", flush=True)
        if self.args.scheduler_down > 0:
            self.scheduler_down()

    def report(self) -> bool:
        """The table; whether every scenario reached its goal (all runs ended, none charged that never ran)."""
        ok = True
        print("\n  scenario                completed  failed by reason                          never-ran USD  s")
        for name, completed, failed, never, wall, _ in self.rows:
            ended = completed + sum(v for k, v in failed.items() if not k.startswith("never ended"))
            ok &= ended == self.args.restart_runs and never < 1e-9 and name not in self.broken
            print(f"  {name:22s}  {completed:9d}  {json.dumps(failed):40s}  {never:13.4f}  {wall:.0f}")
        return ok
