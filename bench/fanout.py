"""Batch inference at scale: a `.map()` over N shards through the control plane, beside ThreadPoolTaskRunner, in one run.

The flow is `flows/batch_inference.py`'s (`shards=N, gpu_fraction=0.25, rows_per_shard=2,
seconds_per_shard=0.0`); the anchor is the same map of a plain `@task` under
`ThreadPoolTaskRunner`, against the same Prefect server. For each size it prints
wall time, cost per shard, and the peak threads and peak RSS of the flow process
and of the control plane (sampled every 0.2 s), checks every shard's result, and
prints the ratios the issue sets as targets: cost per shard at most 2x
ThreadPool's, flat from the smallest to the largest size (at most 1.2x), at most
200 threads in each process, the plane's RSS at the largest size at most 2x at
the smallest.

    .venv/bin/python bench/fanout.py --sizes 1000 10000              # embedded control plane (the defaults)
    .venv/bin/python bench/fanout.py --sizes 10000 --served          # `aisched serve`, its own scheduler, 2 workers
    .venv/bin/python bench/fanout.py --prefect-database postgresql+asyncpg://postgres@127.0.0.1:5432/prefect_bench
    .venv/bin/python bench/fanout.py --sizes 1000 --load-seconds 0 2 --prefect-dask   # a model that loads in 2 s

With `--load-seconds S`, the flow's model (flows/batch_inference.py's `load_model`) takes S
seconds to load in each process that loads it, and every row prints how many loads happened:
at most the bodies the devices allow (16 on 2 x 2 declared GPUs at quarter GPUs) for ours, one
for ThreadPool (one process), one per worker process for prefect-dask (`--prefect-dask`), and
the wall time at S beside the wall time at 0 (target: at most 1.2x).

It starts its own Prefect server (`prefect server start` on 127.0.0.1) unless
PREFECT_API_URL is set, and runs every flow against it. After each runner it waits until that
server has written the run's events (at most 10 minutes) and counts every process's CPU until
then (the other processes' until the flow returns): each runner is charged its own backlog and
no other's (wall time ends with the flow).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402  (Prefect and distributed depend on it)

DECLARED = "2 workers x 2 GPUs, 80 GB, H100"


@contextmanager
def prefect_server(database: str | None = None):
    """A Prefect server on 127.0.0.1 for the run (the SQLite test harness falls behind at 10,000 task runs), on
    `database` (a SQLAlchemy URL, `postgresql+asyncpg://...`) where given: a SQLite Prefect server answered 503
    to a new flow run after the 1,000-shard runs here."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tempfile.mkdtemp(prefix="fanout-prefect-")
    env = {**os.environ, "PREFECT_HOME": home,
           **({"PREFECT_API_DATABASE_CONNECTION_URL": database} if database else {})}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/api"
    import httpx

    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        os.environ["PREFECT_API_URL"] = url  # the control plane and workers this bench starts
        from prefect.settings import PREFECT_API_URL, temporary_settings

        # This process imported Prefect before: its settings were read then, and without this its flows would run
        # against an ephemeral server of their own (a second server, which the control plane never talks to).
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Peaks:
    """Peak threads and RSS of this process and of the control plane's, sampled in the background."""

    def __init__(self, plane_pid: int | None = None) -> None:
        self.plane_pid = plane_pid
        self.flow_threads = self.flow_rss = self.plane_threads = self.plane_rss = 0
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds so far): where a shard's cost goes
        self._stop = threading.Event()
        self._server_only = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _plane(self) -> psutil.Process | None:
        if self.plane_pid is not None:
            return psutil.Process(self.plane_pid)
        for child in psutil.Process().children(recursive=True):
            try:
                if "aisched_prefect.control.server" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        return None

    def _run(self) -> None:
        me, plane = psutil.Process(), None
        start = {p.pid: sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)]}
        while not self._stop.wait(0.2):
            self.flow_threads = max(self.flow_threads, me.num_threads())
            self.flow_rss = max(self.flow_rss, me.memory_info().rss)
            try:
                plane = plane or self._plane()
                if plane is not None:
                    self.plane_threads = max(self.plane_threads, plane.num_threads())
                    self.plane_rss = max(self.plane_rss, plane.memory_info().rss)
            except psutil.Error:
                plane = None
            self._sample_cpu(me, plane, start)

    def _sample_cpu(self, me: psutil.Process, plane: psutil.Process | None, start: dict[int, float]) -> None:
        procs = [me, *me.children(recursive=True)]
        if plane is not None and plane.pid not in {p.pid for p in procs}:
            procs += [plane, *plane.children(recursive=True)]
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
                t = p.cpu_times()
                # Each process's own time only: a parent's children times include every child it reaped (the plane
                # reaps its scheduler and workers as it stops, a worker its zygotes, the flow its plane), whose own
                # times are counted here already: with them, whether the last sample came after the reaping swung the
                # plane's figure between 14 and 30 ms a shard. A body that lives less than a sample (0.2 s) is missed.
                used = t.user + t.system
            except psutil.Error:
                continue
            if self._server_only and not is_prefect_server(cmd):
                continue
            role = ("flow" if p.pid == me.pid else "plane" if plane is not None and p.pid == plane.pid
                    else "scheduler" if "scheduler" in cmd else "zygotes" if "zygote" in cmd
                    else "prefect server" if is_prefect_server(cmd) else "workers")
            self.cpu[p.pid] = (role, used - start.get(p.pid, 0.0))

    def until_quiet(self) -> float:
        """Keep counting the Prefect server's CPU after the run until it has written the run's events: Prefect
        records a task run's state events after the flow moves on, so a short run's window alone leaves most of its
        server cost out (ThreadPool at 1,000: 1.4 ms a shard in its window, 19.0 until written). How long it took."""
        self._server_only = True  # the rest stop with the flow (a process reaped later lends its CPU to its parent)
        return quiet_prefect_server(most_seconds=600.0)

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, used in self.cpu.values():
            out[role] = out.get(role, 0.0) + used
        return out

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def is_prefect_server(cmd: str) -> bool:
    """Whether a process (its command line) is the Prefect server's (`prefect server start`, its uvicorn app)."""
    return "prefect" in cmd and "server" in cmd and "aisched_prefect" not in cmd


def quiet_prefect_server(most_seconds: float = 120.0) -> float:
    """Wait until the Prefect server this bench started has written the last run's events (its processes use under
    a tenth of a core over a second), so the next runner's window is not charged the last one's backlog (measured:
    45.6 ms of server CPU a shard for ours right after the ThreadPool run, 19.6 alone). How long it waited."""
    procs = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if is_prefect_server(cmd):
            procs.append(child)
    start = time.perf_counter()
    while procs and time.perf_counter() - start < most_seconds:
        try:
            before = sum(sum(p.cpu_times()[:2]) for p in procs)
            time.sleep(1.0)
            if sum(sum(p.cpu_times()[:2]) for p in procs) - before < 0.1:
                break
        except psutil.Error:
            break
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--served", action="store_true", help="against `aisched serve` with its own scheduler and "
                        "two workers (else each flow run starts an embedded control plane)")
    parser.add_argument("--skip-threadpool", action="store_true")
    parser.add_argument("--load-seconds", type=float, nargs="+", default=[0.0],
                        help="how long the model takes to load in each process that loads it (one row per value)")
    parser.add_argument("--prefect-dask", action="store_true", help="also the same map under prefect-dask's "
                        "DaskTaskRunner (a local cluster of 2 worker processes)")
    parser.add_argument("--prefect-database", help="the Prefect server's database (a SQLAlchemy URL, e.g. "
                        "postgresql+asyncpg://postgres@127.0.0.1:5432/prefect_bench); default: its SQLite")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)

    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from aisched_prefect import AISchedTaskRunner
    from blocks import AuthorityBlock, BudgetBlock, Grant
    from flows.batch_inference import batch_inference, gather, make_shards

    @task
    def plain_score(shard: dict[str, Any], model: str, seconds: float, load_seconds: float = 0.0,
                    load_log: str | None = None) -> dict[str, Any]:
        from flows.batch_inference import load_model

        started = time.time()
        scorer = load_model(model, load_seconds, load_log)
        scores = [scorer.score(row) for row in shard["rows"]]
        return {"shard": shard["shard"], "rows": len(scores), "mean_score": sum(scores) / len(scores),
                "worker": "local", "device": "cpu", "gpu_type": None, "started": started, "ended": time.time(),
                "pid": os.getpid(), "process": scorer.process}

    def plain_map(shards: int, load_seconds: float, load_log: str, task_runner: Any) -> dict[str, Any]:
        from prefect import unmapped

        @flow(task_runner=task_runner)
        def plain(shards: int) -> dict[str, Any]:
            futures = plain_score.map(make_shards(shards, 2), model=unmapped(f"m-{load_log}"),
                                      seconds=unmapped(0.0), load_seconds=unmapped(load_seconds),
                                      load_log=unmapped(load_log))
            return gather(futures, shards)

        return plain(shards)

    def loads(path: str) -> int:
        return len(Path(path).read_text().split()) if Path(path).exists() else 0

    # Isolated bodies (other UIDs) note their loads here, the tenant's declared data path (`--served`); not under /tmp,
    # which an isolated body sees only as its own private one.
    scratch = Path(tempfile.mkdtemp(prefix="fanout-loads-", dir="/var/tmp"))
    scratch.chmod(0o777)

    authority = AuthorityBlock(grants=[Grant(id="fanout", principal="bench/fanout", kinds=["inference"],
                                             max_gpus=1, max_cost_per_run=1.0)])
    budget = BudgetBlock(limit=1_000_000, gpu_hour_prices={"*": 1.0})
    rows: list[dict[str, Any]] = []
    with prefect_server(args.prefect_database):
        plane = cluster = None
        if args.served:
            from bench.overhead import external_cluster
            from aisched_prefect.control.process import ControlPlaneProcess
            from aisched_prefect.control.service import load_or_make_key
            from dask_gpu.tickets import TicketSigner

            home = Path(tempfile.mkdtemp(prefix="fanout-plane-"))
            key = TicketSigner(load_or_make_key(home / "control.key")).public_key.hex()
            # The load log lies on the tenant's declared data path: an isolated body's own /tmp is private.
            cluster = external_cluster(2, "2 GPUs, 80 GB, H100", key, env={
                "DASK_DASK_GPU__ISOLATION__TENANT_PATHS": f"bench={scratch}"})
            address = cluster.__enter__()
            plane = ControlPlaneProcess(home, dask_address=address).start()
            plane.apply("authority", "fanout", authority)
            plane.apply("budget", "fanout", budget)
            runner = AISchedTaskRunner(control_plane=plane.url, credential=plane.issue(
                "bench/fanout", authority="fanout", budget="fanout"), approver="policy")
        else:
            authority.save("fanout", overwrite=True)
            budget.save("fanout", overwrite=True)
            runner = AISchedTaskRunner(principal="bench/fanout", authority="fanout", budget="fanout",
                                       declared=DECLARED, approver="policy")
        try:
            for n in args.sizes:
                for load in args.load_seconds:
                    anchors = [] if args.skip_threadpool else [("ThreadPoolTaskRunner", ThreadPoolTaskRunner())]
                    if args.prefect_dask:
                        from prefect_dask import DaskTaskRunner

                        anchors.append(("prefect-dask DaskTaskRunner", DaskTaskRunner(cluster_kwargs={
                            "n_workers": 2, "processes": True, "threads_per_worker": 4, "dashboard_address": ":0",
                            "local_directory": str(scratch)})))
                    for name, anchor in anchors:
                        log = str(scratch / f"{name.split()[0]}-{n}-{load}")
                        quiet_prefect_server()
                        with Peaks() as peaks:
                            t0 = time.perf_counter()
                            out = plain_map(n, load, log, anchor)
                            wall = time.perf_counter() - t0
                            peaks.until_quiet()
                        assert out["shards"] == n
                        rows.append({"runner": name, "n": n, "wall": wall, "peaks": peaks, "load": load,
                                     "loads": loads(log), "processes": out["processes"]})
                    log = str(scratch / f"ours-{n}-{load}")
                    Path(log).touch()
                    os.chmod(log, 0o666)  # each isolated body (a UID of its own) appends its loads to it
                    quiet_prefect_server()
                    with Peaks(plane.proc.pid if plane is not None else None) as peaks:
                        t0 = time.perf_counter()
                        out = batch_inference.with_options(task_runner=runner)(
                            shards=n, gpu_fraction=0.25, rows_per_shard=2, seconds_per_shard=0.0,
                            load_seconds=load, load_log=log)
                        wall = time.perf_counter() - t0
                        peaks.until_quiet()
                    assert out["shards"] == n and [r["shard"] for r in out["results"]] == list(range(n))
                    expected = plain_score.fn({"shard": 0, "rows": [0, 1]}, "examples-regressor", 0.0)["mean_score"]
                    assert abs(out["results"][0]["mean_score"] - expected) < 1e-12
                    rows.append({"runner": "AISchedTaskRunner" + (" (served)" if plane else " (embedded)"), "n": n,
                                 "wall": wall, "peaks": peaks, "load": load, "loads": loads(log),
                                 "processes": out["processes"]})
                    print_rows(rows)
        finally:
            if plane is not None:
                plane.stop()
            if cluster is not None:
                cluster.__exit__(None, None, None)
            shutil.rmtree(scratch, ignore_errors=True)
    print_rows(rows, final=True)


def print_rows(rows: list[dict[str, Any]], final: bool = False) -> None:
    print(("\nfinal: " if final else "\n") + f"batch inference fan-out, {os.cpu_count()} cores")
    for r in rows:
        p = r["peaks"]
        print(f"  {r['runner']:32s} {r['n']:6d} shards, load {r['load']:g} s: {r['wall']:8.1f} s "
              f"{1000 * r['wall'] / r['n']:7.2f} ms/shard, {r['loads']} loads in {r['processes']} processes"
              f"  flow: {p.flow_threads:4d} threads {p.flow_rss / 2**20:7.0f} MB"
              + (f"  plane: {p.plane_threads:4d} threads {p.plane_rss / 2**20:7.0f} MB" if p.plane_rss else ""))
        cpu = p.cpu_by_role()
        print("      CPU ms per shard: " + ", ".join(f"{role} {1000 * used / r['n']:.1f}"
                                                     for role, used in sorted(cpu.items(), key=lambda x: -x[1]))
              + f" (all {1000 * sum(cpu.values()) / r['n']:.1f}; each process until the Prefect server has written the "
              "run's events; Prefect server not counted where it is not ours)")
    ours = [r for r in rows if r["runner"].startswith("AISched")]
    base = {(r["n"], r["load"]): r for r in rows if r["runner"] == "ThreadPoolTaskRunner"}
    unloaded = {r["n"]: r for r in ours if r["load"] == 0}
    for r in ours:
        if (r["n"], r["load"]) in base:
            print(f"  {r['n']:6d} shards, load {r['load']:g} s: cost per shard / ThreadPool's = "
                  f"{r['wall'] / base[(r['n'], r['load'])]['wall']:.2f} (target <= 1.5 at load 0)")
        if r["load"] and r["n"] in unloaded:
            print(f"  {r['n']:6d} shards, load {r['load']:g} s: {r['loads']} loads (target <= the bodies the devices "
                  f"allow: 16 on 2 x 2 GPUs at a quarter), wall / wall at load 0 = "
                  f"{r['wall'] / unloaded[r['n']]['wall']:.2f} (target <= 1.5)")
    ours = [r for r in ours if r["load"] == 0] or ours
    if len(ours) > 1:
        small, large = ours[0], ours[-1]
        print(f"  cost per shard at {large['n']} / at {small['n']} = "
              f"{(large['wall'] / large['n']) / (small['wall'] / small['n']):.2f} (target <= 1.1)")
        if small["peaks"].plane_rss:
            print(f"  plane RSS at {large['n']} / at {small['n']} = "
                  f"{large['peaks'].plane_rss / small['peaks'].plane_rss:.2f} (target <= 2.0)")
    print(f"  peak threads: flow {max(r['peaks'].flow_threads for r in ours) if ours else 0}, plane "
          f"{max(r['peaks'].plane_threads for r in ours) if ours else 0} (target <= 200 each)")


if __name__ == "__main__":
    main()
