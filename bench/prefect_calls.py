"""Prefect API calls per task run: a map of N trivial tasks under ThreadPoolTaskRunner, then the same map of a
trivial AI task under AISchedTaskRunner (embedded control plane, declared GPUs), in one process against one
Prefect test server. Every HTTP request this process makes is counted by method and path (httpx's `send`
wrapped); the calls to the control plane are listed apart. Prefect's events (task-run states travel as events on
its websocket) are counted by name where the flow process sends them (`EventsWorker._handle`), and the log lines
sent to Prefect's API where they are queued (`emit_api_log`): a server's work per task run is what it is sent.

    .venv/bin/python bench/prefect_calls.py --tasks 200
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

COUNTS: collections.Counter[str] = collections.Counter()
_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32,}")
_async_send, _sync_send = httpx.AsyncClient.send, httpx.Client.send


def _name(request: httpx.Request) -> str:
    return f"{request.method} {_ID.sub('{id}', request.url.path)}"


async def _counted_async(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
    COUNTS[_name(request)] += 1
    return await _async_send(self, request, *args, **kwargs)


def _counted_sync(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
    COUNTS[_name(request)] += 1
    return _sync_send(self, request, *args, **kwargs)


httpx.AsyncClient.send, httpx.Client.send = _counted_async, _counted_sync  # type: ignore[method-assign]


def _count_events_and_logs() -> None:
    """Count every event the flow process sends to Prefect's server, by name, and every log line it sends."""
    import prefect.logging.handlers as handlers
    from prefect.events.worker import EventsWorker

    handle, emit_log = EventsWorker._handle, handlers.emit_api_log

    async def counted_event(self, event):  # type: ignore[no-untyped-def]
        COUNTS[f"event {event.event}"] += 1
        return await handle(self, event)

    def counted_log(log):  # type: ignore[no-untyped-def]
        COUNTS["log line"] += 1
        return emit_log(log)

    EventsWorker._handle = counted_event  # type: ignore[method-assign]
    handlers.emit_api_log = counted_log


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=200)
    n = parser.parse_args().tasks
    _count_events_and_logs()
    from prefect import flow, task
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.testing.utilities import prefect_test_harness

    from aisched_prefect import AISchedTaskRunner, ai_task
    from blocks import AuthorityBlock, BudgetBlock, Grant

    @task
    def trivial(i: int) -> int:
        return i

    @ai_task(gpus=0.25, kind="inference", est_seconds=1)
    def trivial_ai(i: int) -> int:
        return i

    def timed(runner, fn) -> float:  # type: ignore[no-untyped-def]
        @flow(task_runner=runner)
        def mapped(k: int) -> int:
            return sum(f.result() for f in fn.map(range(k)))

        start = time.time()
        assert mapped(n) == n * (n - 1) // 2
        return time.time() - start

    with prefect_test_harness(server_startup_timeout=180), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        AuthorityBlock(grants=[Grant(id="calls", principal="bench/flow", max_gpus=1, max_cost_per_run=1)]).save(
            "bench-calls", overwrite=True)
        BudgetBlock(limit=1_000_000, gpu_hour_prices={"*": 1.0}).save("bench-calls", overwrite=True)
        timed(ThreadPoolTaskRunner(), trivial)  # the server's first flow run is not counted
        rows = []
        for name, runner, fn in (
                ("ThreadPoolTaskRunner", ThreadPoolTaskRunner(), trivial),
                ("AISchedTaskRunner", AISchedTaskRunner(principal="bench/flow", authority="bench-calls",
                                                        budget="bench-calls", declared="2 workers x 2 GPUs, 80 GB, H100"),
                 trivial_ai)):
            COUNTS.clear()
            wall = timed(runner, fn)
            rows.append((name, wall, dict(COUNTS)))
    for name, wall, counts in rows:
        sent = {k: v for k, v in counts.items() if k.startswith(("event ", "log line"))}
        plane = {k: v for k, v in counts.items() if k not in sent and k.split()[1].startswith("/v1/")}
        prefect = {k: v for k, v in counts.items() if k not in plane and k not in sent}
        print(f"{name}: {n} task runs in {wall:.1f} s; Prefect API calls {sum(prefect.values())} "
              f"({sum(prefect.values()) / n:.2f} a task run); events and log lines sent to Prefect "
              f"{sum(sent.values())} ({sum(sent.values()) / n:.2f} a task run); control plane calls {sum(plane.values())}")
        for k, v in sorted({**prefect, **sent}.items(), key=lambda kv: -kv[1]):
            print(f"    {v:6d}  {k}")
        for k, v in sorted(plane.items(), key=lambda kv: -kv[1]):
            print(f"    {v:6d}  (control plane) {k}")


if __name__ == "__main__":
    main()
