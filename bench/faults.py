"""Faults at scale: a flow process killed under its waiting and running runs, and every connection cut under 1,000.

Both parts run against one real control plane (`aisched serve` in its own
process, `ControlPlaneProcess`) with a Dask cluster of its own, its scheduler in
a process of its own, and a Prefect server on 127.0.0.1 (started here unless
PREFECT_API_URL is set). The cluster is declared so that exactly `--running`
runs fit at once: quarter-GPU runs (`@ai_task(gpus=0.25)`) on 2 workers x
running/8 declared H100s (16: 2 x 2), two worker processes on a 2-core machine
instead of the 4 x 4 whole-GPU layout's four. Bodies run as the worker's user
(`DASK_DASK_GPU__ISOLATION__MODE=shared`): each writes `start i` / `end i` to
one marks file, which is how the bench sees what ran, and how often.

1. Killed flow. A flow process (a subprocess) maps `--waiting + --running` AI
   tasks whose bodies wait for a gate file. Once the plane's queue
   (`GET /v1/queue`) shows `--running` running and `--waiting` queued and every
   running body has started, the process is killed (SIGKILL). The plane's
   session lease (`AISCHED_SESSION_LEASE_SECONDS`, `--lease`) then lapses: the
   waiting runs must leave the queue, with their holds voided, while the running
   ones still run. Then the gate opens, the running ones finish, and every run
   must have exactly one admission and one settlement, the budget nothing
   pending and posted equal to the settlements' charges.
2. Connections cut. A flow process maps `--cut-runs` AI tasks through a TCP
   proxy (tests.helpers.CuttingProxy) that drops every open connection every
   `--cut-every` seconds: while the runs are submitted, while they all wait
   (the first `--running` hold the devices behind a gate, the rest are queued;
   the gate opens after `--cuts` cuts there), and while they drain. Every
   result must be right, every body must have run once, every run must have one
   admission and one settlement.

3. Restarts (bench/fault_restarts.py, `--restarts`): the plane killed and started again 0, 5 and 25 s after a
   `--restart-runs` map was admitted, the ledger's Postgres gone `--ledger-down` s while runs finish (with
   `--postgres URL`), the scheduler gone `--scheduler-down` s under the map. Each prints runs completed, failed by
   reason, and money charged for runs that never ran (goal 0).

    PYTHONPATH=. .venv/bin/python bench/faults.py                      # --waiting 500 --running 16 --cut-runs 1000
    PYTHONPATH=. .venv/bin/python bench/faults.py --waiting 40 --running 8 --cut-runs 100   # in a few minutes
    PYTHONPATH=. .venv/bin/python bench/faults.py --restarts --skip-kill --skip-cut \
        --postgres postgresql://postgres@127.0.0.1:5432/test           # the restart scenarios at 1,000 runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FRACTION = 0.25
PRINCIPAL = "bench/faults"

FLOW_SCRIPT = '''
import hashlib, json, os, sys, time
from prefect import flow, unmapped
from prefect.context import FlowRunContext
from aisched_prefect import AISchedTaskRunner, ai_task

url, token, n, gate, marks, out, est, fraction = sys.argv[1:9]


def expected(i):
    return int(hashlib.sha256(f"shard-{i}".encode()).hexdigest()[:12], 16)


def mark(marks, what):
    fd = os.open(marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, what.encode())
    finally:
        os.close(fd)


@ai_task(gpus=float(fraction), kind="inference", est_seconds=float(est), name="shard")
def shard(i, gate, marks):
    mark(marks, f"start {i}\\n")
    deadline = time.time() + 900
    while not os.path.exists(gate) and time.time() < deadline:
        time.sleep(0.05)
    mark(marks, f"end {i}\\n")
    return expected(i)


@flow(task_runner=AISchedTaskRunner(control_plane=url, credential=token), name="faults-bench")
def faults(n: int) -> list:
    print(FlowRunContext.get().flow_run.id, flush=True)
    return [f.result() for f in shard.map(range(n), gate=unmapped(gate), marks=unmapped(marks))]


with open(out, "w") as f:
    json.dump(faults(int(n)), f)
'''


def expected(i: int) -> int:
    """Shard i's right result (the flow's body computes the same)."""
    return int(hashlib.sha256(f"shard-{i}".encode()).hexdigest()[:12], 16)


def declared_for(running: int) -> str:
    """An inventory on which exactly `running` quarter-GPU runs fit at once."""
    if running % 8 == 0:
        return f"2 workers x {running // 8} GPUs, 80 GB, H100"
    if running % 4 == 0:
        return f"1 worker x {running // 4} GPUs, 80 GB, H100"
    raise SystemExit(f"--running {running}: runs take a quarter GPU each, so it must be a multiple of 4")


class Bench:
    """The plane, its tenants and the checks' table."""

    def __init__(self, args: argparse.Namespace, plane: Any, work: Path) -> None:
        self.args, self.plane, self.work = args, plane, work
        self.checks: list[tuple[str, bool, str]] = []

    def check(self, what: str, ok: bool, figure: Any = "") -> bool:
        self.checks.append((what, bool(ok), str(figure)))
        print(f"  [{'reached' if ok else 'NOT reached'}] {what}" + (f": {figure}" if figure != "" else ""), flush=True)
        return bool(ok)

    def tenant(self, name: str) -> str:
        from blocks import AuthorityBlock, BudgetBlock, Grant

        self.plane.apply("authority", name, AuthorityBlock(grants=[Grant(
            id=name, principal=PRINCIPAL, kinds=["inference"], max_gpus=1, max_cost_per_run=1.0)]))
        self.plane.apply("budget", name, BudgetBlock(limit=1_000_000, gpu_hour_prices={"*": 1.0}))
        return self.plane.issue(PRINCIPAL, authority=name, budget=name)

    def queue(self) -> dict[str, Any]:
        q = self.plane.ok("GET", "/v1/queue")
        return {"queued": q["queued"], "running": q["running"]}

    def start_flow(self, part: str, url: str, token: str, n: int, est: float) -> tuple[subprocess.Popen, Path, Path,
                                                                                        Path, str]:
        script, gate, marks, out = (self.work / f"{part}.{x}" for x in ("py", "gate", "marks", "json"))
        script.write_text(FLOW_SCRIPT)
        env = {**os.environ, "PREFECT_LOGGING_LEVEL": "ERROR",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, str(script), url, token, str(n), str(gate), str(marks), str(out),
                                 str(est), str(FRACTION)], stdout=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        flow_run_id = (proc.stdout.readline() if proc.stdout else "").strip()
        if not flow_run_id:
            raise SystemExit(f"the {part} flow process did not start (exit {proc.wait()}); its error is above")
        return proc, gate, marks, out, flow_run_id

    def poll(self, check: Any, timeout: float, every: float = 0.5) -> Any:
        """`check()` until it is true (returned) or `timeout` s pass (None): the plane has no event a bench can wait on."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got or time.monotonic() > deadline:
                return got or None
            time.sleep(every)

    def evidence(self, flow_run_id: str) -> dict[str, list[Any]]:
        """Task run id -> its records of this flow run, in order."""
        per_run: dict[str, list[Any]] = {}
        for r in self.plane.records(flow_run_id):
            if r.task_run_id:
                per_run.setdefault(r.task_run_id, []).append(r)
        return per_run

    def books(self, budget: str, settlements: list[Any]) -> tuple[bool, str]:
        """The budget's account against the settlements' charges: nothing pending, posted = what they charged."""
        charged = sum(s.get("charged", 0.0) for r in settlements for s in r.payload.get("settlements", [])
                      if s.get("budget") in (None, budget) or budget in str(s.get("budget")))
        rows = [a for a in self.plane.ledger().accounts() if budget in a["budget"]]
        pending = sum(a["pending"] for a in rows)
        posted = sum(a["posted"] for a in rows)
        ok = bool(rows) and pending == 0 and abs(posted - charged) < 1e-6 * max(1, len(settlements))
        return ok, (f"accounts {[a['budget'] + '/' + a['period'] for a in rows]}: pending {pending:.6f}, posted "
                    f"{posted:.6f}, settlements charged {charged:.6f}")

    # -- 1 ------------------------------------------------------------------------------------------
    def killed_flow(self) -> dict[str, Any]:
        a = self.args
        n, lease = a.waiting + a.running, a.lease
        print(f"\n1. a flow process killed under {a.waiting} waiting and {a.running} running runs", flush=True)
        token = self.tenant("faults-kill")
        t0 = time.monotonic()
        proc, gate, marks, _, flow_run_id = self.start_flow("kill", self.plane.url, token, n, est=a.est_seconds)
        started = lambda: {int(l.split()[1]) for l in _lines(marks) if l.startswith("start ")}  # noqa: E731
        full = self.poll(lambda: (q := self.queue())["running"] == a.running and q["queued"] == a.waiting
                         and len(started()) == a.running and q, a.timeout)
        print(f"  queue {self.queue()} after {time.monotonic() - t0:.1f} s (flow run {flow_run_id})", flush=True)
        self.check(f"the queue showed {a.running} running and {a.waiting} queued, the running bodies started",
                   full, f"{time.monotonic() - t0:.1f} s after the flow started")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        print(f"  killed the flow process (SIGKILL) at {killed - t0:.1f} s", flush=True)

        def left() -> Any:
            q = self.queue()
            ended = [r for rs in self.evidence(flow_run_id).values() for r in rs if r.kind == "settlement"]
            return (q, ended) if q["queued"] == 0 and len(ended) >= a.waiting else None

        # The lease runs from the dead process's last poll's end (up to 20 s after it died).
        gone = self.poll(left, lease + 20 + 60, every=1.0)
        to_leave = time.monotonic() - killed
        still = self.queue()
        self.check(f"the {a.waiting} waiting runs left the queue (session lease {lease:g} s)", gone,
                   f"{to_leave:.1f} s after the kill; queue then {still}")
        self.check(f"the {a.running} running runs still ran when the waiting ones had left",
                   still["running"] == a.running and not any(l.startswith("end ") for l in _lines(marks)),
                   f"queue {still}")
        gate.touch()
        done = self.poll(lambda: (e := self.evidence(flow_run_id)) and
                         sum(1 for rs in e.values() if any(r.kind == "settlement" for r in rs)) >= n and e, a.timeout,
                         every=1.0)
        to_settle = time.monotonic() - killed
        per_run = done or self.evidence(flow_run_id)
        kinds = {tr: [r.kind for r in rs] for tr, rs in per_run.items()}
        once = [tr for tr, ks in kinds.items() if ks.count("admission") == 1 and ks.count("settlement") == 1]
        self.check(f"every one of the {n} admitted runs has exactly one admission and one settlement",
                   len(kinds) == n and len(once) == n,
                   f"{len(kinds)} runs in the evidence, {len(once)} with one of each; "
                   f"{to_settle:.1f} s from the kill to all settled")
        settlements = [r for rs in per_run.values() for r in rs if r.kind == "settlement"]
        outcomes = Counter(r.payload.get("outcome") for r in settlements)
        ran = started()
        abandoned = [r for r in settlements if r.payload.get("outcome") == "abandoned-while-queued"]
        self.check(f"the {a.waiting} that never started are abandoned-while-queued, nothing charged, holds voided",
                   len(abandoned) == a.waiting and all(_charged(r) == 0 for r in abandoned)
                   and all(s.get("status") == "voided" for r in abandoned for s in r.payload.get("settlements", [])),
                   f"outcomes {dict(outcomes)}")
        finished = [r for r in settlements if r.payload.get("outcome") != "abandoned-while-queued"]
        # Exactly `running` bodies ever started (the marks), each ended once: none of the waiting ones began.
        self.check(f"the {a.running} running ones finished, each charged once",
                   len(finished) == a.running and all(r.payload.get("outcome") == "completed" and _charged(r) > 0
                                                      for r in finished)
                   and len(ran) == a.running and _ends(marks) == Counter({i: 1 for i in ran}),
                   f"{len(finished)} settled: {sum(_charged(r) for r in finished):.6f} charged; bodies started "
                   f"{len(ran)}, ended {sum(_ends(marks).values())}")
        empty = self.poll(lambda: (q := self.queue())["queued"] == 0 and q["running"] == 0 and q, 60)
        self.check("the queue ends empty", empty, self.queue())
        ok, figure = self.books("faults-kill", settlements)
        self.check("the budget has nothing pending and posted = the settlements' charges", ok, figure)
        return {"kill_to_left": to_leave, "kill_to_settled": to_settle, "runs": n}

    # -- 2 ------------------------------------------------------------------------------------------
    def cut_connections(self) -> dict[str, Any]:
        from tests.helpers import CuttingProxy

        a = self.args
        n = a.cut_runs
        print(f"\n2. every connection cut, again and again, under {n} runs ({a.running} at a time)", flush=True)
        token = self.tenant("faults-cut")
        proxy = CuttingProxy(self.plane.url)
        phases = Counter()
        phase = ["submitting"]
        stop = threading.Event()

        def cutter() -> None:
            while not proxy.open and not stop.wait(0.05):  # the flow's first request: submitting has begun
                pass
            # Submits are a few requests of up to 250 calls each: cut more often while they go.
            while not stop.wait(a.cut_every / 4 if phase[0] == "submitting" else a.cut_every):
                proxy.cut()
                phases[phase[0]] += 1

        t0 = time.monotonic()
        proc, gate, marks, out, flow_run_id = self.start_flow("cut", proxy.url, token, n, est=a.est_seconds)
        threading.Thread(target=cutter, daemon=True).start()
        try:
            waiting = min(n, a.running)
            full = self.poll(lambda: (q := self.queue())["running"] == waiting and q["queued"] == n - waiting and q,
                             a.timeout)
            admitted_at = time.monotonic() - t0
            phase[0] = "all waiting"
            self.poll(lambda: phases["all waiting"] >= a.cuts, a.cuts * a.cut_every * 3 + 30)
            phase[0] = "draining"
            gate.touch()
            try:
                rc = proc.wait(a.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        finally:
            stop.set()
            proxy.close()
        wall = time.monotonic() - t0
        self.check(f"all {n} runs admitted and waiting, {waiting} on the devices and {n - waiting} queued", full,
                   f"{admitted_at:.1f} s after the flow started")
        self.check("cuts happened while submitting, while all waited and while draining",
                   all(phases[p] > 0 for p in ("submitting", "all waiting", "draining")),
                   f"{sum(phases.values())} cuts ({dict(phases)}), {proxy.dropped} open connections dropped")
        results = json.loads(out.read_text()) if out.exists() else None
        self.check(f"the flow completed with every one of the {n} results right",
                   rc == 0 and results == [expected(i) for i in range(n)],
                   f"exit {rc}, {wall:.1f} s, {sum(1 for i, r in enumerate(results or []) if r == expected(i))} right")
        ends = _ends(marks)
        self.check("every body ran exactly once", ends == Counter({i: 1 for i in range(n)}),
                   f"{len(ends)} bodies ended, {sum(1 for c in ends.values() if c > 1)} more than once")
        per_run = self.evidence(flow_run_id)
        kinds = {tr: [r.kind for r in rs] for tr, rs in per_run.items()}
        once = [tr for tr, ks in kinds.items() if ks == ["admission", "settlement"]]
        settlements = [r for rs in per_run.values() for r in rs if r.kind == "settlement"]
        self.check("each run admitted once and settled once (none lost, none twice)",
                   len(kinds) == n and len(once) == n and all(r.payload.get("outcome") == "completed"
                                                              for r in settlements),
                   f"{len(kinds)} runs in the evidence, {len(once)} with exactly [admission, settlement]; "
                   f"outcomes {dict(Counter(r.payload.get('outcome') for r in settlements))}")
        ok, figure = self.books("faults-cut", settlements)
        self.check("the budget has nothing pending and posted = the settlements' charges", ok, figure)
        return {"wall": wall, "cuts": sum(phases.values()), "dropped": proxy.dropped, "runs": n}


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _ends(marks: Path) -> Counter:
    return Counter(int(line.split()[1]) for line in _lines(marks) if line.startswith("end "))


def _charged(record: Any) -> float:
    return sum(s.get("charged", 0.0) for s in record.payload.get("settlements", []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=500, help="runs waiting in the queue when the flow dies")
    parser.add_argument("--running", type=int, default=16, help="runs at once on the cluster (a multiple of 4)")
    parser.add_argument("--cut-runs", type=int, default=1000, help="runs of the connection-cut part")
    parser.add_argument("--cuts", type=int, default=4, help="cuts while all the cut part's runs wait")
    parser.add_argument("--cut-every", type=float, default=2.0, help="seconds between cuts")
    parser.add_argument("--lease", type=float, default=5.0, help="the plane's AISCHED_SESSION_LEASE_SECONDS")
    parser.add_argument("--est-seconds", type=float, default=600.0, help="each run's est_seconds (its hold)")
    parser.add_argument("--timeout", type=float, default=900.0, help="longest wait for any one step")
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument("--skip-cut", action="store_true")
    parser.add_argument("--restarts", action="store_true", help="also run the restart scenarios (fault_restarts.py)")
    parser.add_argument("--restart-runs", type=int, default=1000, help="runs of each restart scenario's map")
    parser.add_argument("--restart-delays", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 5.0, 25.0],
                        help="seconds after the map was admitted that the plane is killed (comma-separated)")
    parser.add_argument("--body-seconds", type=float, default=0.2, help="each restart-scenario body's run time")
    parser.add_argument("--postgres", default="", help="a Postgres URL for the ledger-restart scenario (a schema "
                        "of its own is made and dropped); without it that scenario is skipped")
    parser.add_argument("--ledger-down", type=float, default=4.0, help="seconds the ledger's Postgres is gone")
    parser.add_argument("--scheduler-down", type=float, default=40.0, help="seconds the scheduler is gone (0: skip)")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    command = "PYTHONPATH=. " + " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])

    from aisched_prefect.control.process import ControlPlaneProcess
    from bench.fanout import prefect_server

    declared = declared_for(args.running)
    work = Path(tempfile.mkdtemp(prefix="faults-"))
    os.chmod(work, 0o777)  # bodies write their marks here
    figures: dict[str, Any] = {}
    t0 = time.monotonic()
    with prefect_server():
        bench = Bench(args, None, work)
        restarts = None
        if not (args.skip_kill and args.skip_cut):
            (work / "plane").mkdir()
            plane = ControlPlaneProcess(work / "plane", declared=declared, env={
                "AISCHED_SESSION_LEASE_SECONDS": str(args.lease), "DASK_DASK_GPU__ISOLATION__MODE": "shared",
                "PREFECT_API_URL": os.environ["PREFECT_API_URL"]})
            plane.start()
            bench.plane = plane
            try:
                print(f"control plane {plane.url}, cluster {declared}, quarter-GPU runs: {args.running} at once; "
                      f"session lease {args.lease:g} s", flush=True)
                if not args.skip_kill:
                    figures["kill"] = bench.killed_flow()
                if not args.skip_cut:
                    figures["cut"] = bench.cut_connections()
                chain = plane.ledger().verify()
                bench.check("the evidence chain verifies", chain.ok, f"{chain.records} records")
            finally:
                plane.stop()
        if args.restarts:
            from bench.fault_restarts import RestartFaults

            restarts = RestartFaults(args, work)
            restarts.run()
    print(f"\nfaults bench, {os.cpu_count()} cores, {time.monotonic() - t0:.0f} s in all; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    width = max((len(c[0]) for c in bench.checks), default=0)
    for what, ok, figure in bench.checks:
        print(f"  {what:{width}s}  {'reached' if ok else 'NOT reached':11s}  {figure}")
    if "kill" in figures:
        k = figures["kill"]
        print(f"  killed flow: {k['runs']} runs; kill -> waiting runs out of the queue {k['kill_to_left']:.1f} s, "
              f"kill -> all settled {k['kill_to_settled']:.1f} s (the gate opened once they were out)")
    if "cut" in figures:
        c = figures["cut"]
        print(f"  connections cut: {c['runs']} runs in {c['wall']:.1f} s, {c['cuts']} cuts, "
              f"{c['dropped']} connections dropped")
    restarts_ok = restarts.report() if restarts is not None else True
    print(f"  command: {command}")
    sys.exit(0 if all(ok for _, ok, _ in bench.checks) and restarts_ok else 1)


if __name__ == "__main__":
    main()
