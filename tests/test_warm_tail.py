"""A map's warm bodies end when nothing of their key waits in that flow run (issue 39: defaults that fit the work).

Before: every body a map left warm waited its whole keep-warm time (5 minutes for inference kinds), so a 200-shard
map was charged `warm-idle` several times its work. Now a body ends once no run of its key waits in its own flow run
(after AISCHED_WARM_LINGER_SECONDS), unless its task asked `keep_warm_across_flow_runs=True`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from tests.clusterprocs import single_host
from tests.helpers import tenant, wait_until
from tests.warm_model import score

WHY = "nothing of its key waits in its flow run"  # control.dispatch.warm_tail.WHY: why such a body's idle period ended


@dataclass
class _Req:
    keep_warm_across_flow_runs: bool = False


@dataclass
class _Adm:
    flow_run_id: str
    request: _Req


@dataclass
class _Idle:
    body: str
    since: float
    admission: _Adm


def test_the_spare_bodies_past_their_linger_end_longest_idle_first(monkeypatch):
    import aisched_prefect.control.dispatch.warm_tail as tail
    from aisched_prefect.control.dispatch.warm_tail import excess

    monkeypatch.setattr(tail, "warm_key", lambda adm: "k")
    f1, f2, across = _Adm("f1", _Req()), _Adm("f2", _Req()), _Adm("f3", _Req(True))
    periods = [_Idle("a", 0.0, f1), _Idle("b", 5.0, f1), _Idle("c", 9.5, f1), _Idle("d", 0.0, f2),
               _Idle("e", 0.0, across)]
    waiting = {("k", "f1"): 1}
    got = excess(periods, lambda k, f: waiting.get((k, f), 0), linger=2.0, now=10.0)  # type: ignore[arg-type]
    # f1: three idle, one run waits: two spare, the longest idle first ("a", then "b"); "c" is within its linger
    # anyway. f2: nothing waits: "d" ends. f3 asked to stay warm across flow runs: kept.
    assert sorted(got) == ["a", "b", "d"]
    assert excess(periods, lambda k, f: 5, linger=2.0, now=10.0) == []  # type: ignore[arg-type]
    # While runs of the key still run in the flow run, the linger is three times longer: "b" (idle 5 s) stays.
    busy = excess(periods, lambda k, f: waiting.get((k, f), 0), linger=2.0, now=10.0,  # type: ignore[arg-type]
                  busy=lambda k, f: 1 if f == "f1" else 0)
    assert sorted(busy) == ["a", "d"]


def test_a_maps_shards_not_sent_yet_count_as_waiting_until_all_arrive_or_the_map_goes_quiet():
    """A flow sends a map's shards as Prefect's engines start them: a queue that ran dry mid-map must not end the map's
    bodies (a 1,000-shard map loaded its model 30 to 36 times on 16 places before this)."""
    from aisched_prefect.control.dispatch.warm_tail import Arrivals

    now = [0.0]
    arrivals = Arrivals(quiet_seconds=60.0, clock=lambda: now[0])
    arrivals.arrived("m1", 0, 4, None, "f1")  # refused at admission: counts as arrived, names no key
    assert arrivals.to_come() == {}  # no shard admitted yet: no body of its key to keep
    arrivals.arrived("m1", 1, 4, "k", "f1")
    arrivals.arrived("m1", 1, 4, "k", "f1")  # sent again after a cut: counted once
    arrivals.arrived("m2", 0, None, "k", "f1")  # a map whose size the flow did not know: nothing to wait for
    assert arrivals.to_come() == {("k", "f1"): 2}
    now[0] = 59.0
    arrivals.arrived("m3", 0, 3, "k", "f2")
    assert arrivals.to_come() == {("k", "f1"): 2, ("k", "f2"): 2}
    now[0] = 61.0  # m1's flow sent nothing for a minute: it is not waited for any more
    assert arrivals.to_come() == {("k", "f2"): 2}
    arrivals.arrived("m3", 1, 3, "k2", "f9")  # another flow run's call naming the same map id: not its shard
    assert arrivals.to_come() == {("k", "f2"): 2, ("k2", "f9"): 2}
    arrivals.arrived("m3", 1, 3, "k", "f2")
    arrivals.arrived("m3", 2, 3, "k", "f2")
    assert arrivals.to_come() == {("k2", "f9"): 2}


def test_one_thread_sweeps_however_many_runs_ask():
    """Each run that leaves a body idle asks for a sweep a linger later: one sweeper thread serves them all, at the
    earliest time asked (a timer thread each had a 1,000-shard map's plane at 1,000 threads)."""
    import threading

    from aisched_prefect.control.dispatch.warm_tail import WarmTail

    swept = threading.Event()

    class Books:
        def idle_periods(self):
            swept.set()
            return []

    tail = WarmTail(Books(), lambda: {}, lambda: 30.0)  # type: ignore[arg-type]
    before = threading.active_count()
    for _ in range(200):
        tail.after()
    assert threading.active_count() <= before + 1
    tail.after(0.0)  # an earlier sweep asked later is not held behind the 30 s ones
    assert swept.wait(10), "the sweep asked for now did not run"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api):
    with single_host(tmp_path_factory.mktemp("warm-tail"), env={"AISCHED_MAX_KEEP_WARM_SECONDS": "3600"}) as procs:
        yield procs


@pytest.mark.usefixtures("prefect_api")
def test_a_maps_bodies_end_when_nothing_of_their_key_waits_in_its_flow_run(cluster, tmp_path):
    t = tenant(cluster.plane)
    log = tmp_path / "loads"
    long_warm = score.with_options(keep_warm=600)  # asks for 10 minutes: the map's tail is what it is charged

    @flow(task_runner=t.runner(max_workers=12))
    def batch():
        results = [f.result() for f in long_warm.map(range(12), log=str(log))]
        # The flow run still lives (its session polls): the bodies end because nothing of their key waits.
        wait_until(lambda: not cluster.warm_bodies(), 60, "the map's bodies to end once nothing of their key waits")
        return results, FlowRunContext.get().flow_run.id

    results, flow_run_id = batch()
    loads = log.read_text().split("\n")[:-1]
    assert 1 <= len(loads) <= 4  # still warm within the map: one load per body

    def settled() -> list:
        records = cluster.plane.records(flow_run_id)
        holds = [r for r in records if r.kind == "warm-hold"]
        idle = [r for r in records if r.kind == "warm-idle"]
        return idle if idle and len(idle) == len(holds) else []

    idle = wait_until(settled, 60, "every idle period to be settled")
    tails = [r for r in idle if r.payload["ended"] == WHY]
    assert len(tails) == len(set(loads))  # each body's last idle period ended because nothing waited
    assert all(r.payload["seconds"] < 60 for r in idle)  # seconds of tail, not the 600 s asked
    _explained_and_reported(cluster, str(flow_run_id), shards=12, bodies=len(set(loads)))


def _explained_and_reported(cluster, flow_run_id: str, shards: int, bodies: int) -> None:
    """`aisched explain` sums the map up (shards, cold and warm starts, bodies, idle per body), says of each run cold
    or warm and which body, prints no raw dict; `aisched report` shows idle time beside the work it served."""
    import re

    from typer.testing import CliRunner

    from aisched_prefect.cli import app

    env = {"COLUMNS": "250"}
    out = CliRunner().invoke(app, ["explain", flow_run_id, "--ledger", cluster.plane.ledger_url], env=env)
    assert out.exit_code == 0, out.output
    text = out.output
    assert f"{shards} task run(s)" in text and "cold starts" in text and "idle s per body" in text
    summary = next(line for line in text.splitlines() if "score" in line and "│" in line)
    cells = [c.strip() for c in summary.split("│")[1:-1]]
    assert cells[1:6] == [str(shards), str(bodies), str(shards - bodies), "0", str(bodies)], cells
    assert text.count("COLD start in body") + text.count("WARM start in body") == 10  # the first ten task runs
    assert "2 more task runs" in text and "--all" in text
    assert not re.search(r"\{'|': \{|\[\{", text), text  # no raw dict or list of dicts anywhere
    everything = CliRunner().invoke(app, ["explain", flow_run_id, "--all", "--ledger", cluster.plane.ledger_url],
                                    env=env).output
    assert everything.count("COLD start in body") + everything.count("WARM start in body") == shards
    assert "IDLE SETTLED for warm body" in everything and not re.search(r"\{'|': \{|\[\{", everything)
    report = CliRunner().invoke(app, ["report", "--ledger", cluster.plane.ledger_url, "--by", "kind",
                                      "--flow-run", flow_run_id], env=env)
    assert report.exit_code == 0, report.output
    assert "warm-idle of batch-inference" in report.output and "of its work's charge" in report.output
    assert "idle time, beside the work it served" in report.output


@pytest.mark.usefixtures("prefect_api")
def test_a_task_that_asked_to_stay_warm_across_flow_runs_waits_for_the_next(cluster, tmp_path):
    wait_until(lambda: not cluster.warm_bodies(), 60, "earlier bodies to end")
    t = tenant(cluster.plane)
    log = tmp_path / "loads"
    service = score.with_options(keep_warm=600, keep_warm_across_flow_runs=True)

    @flow(task_runner=t.runner(max_workers=4))
    def batch():
        return [f.result()["pid"] for f in service.map(range(4), log=str(log))]

    first = set(batch())
    assert len(cluster.warm_bodies()) == len(first)  # still warm after its flow run
    second = set(batch())
    # The next flow run's shards start in the bodies that waited: a fresh body only for a shard beyond them (four
    # shards at once, and the first run may have served its four with three bodies), and no body loads twice.
    assert second & first and len(second - first) <= 4 - len(first), (first, second)
    assert len(log.read_text().split("\n")[:-1]) == len(first | second)  # one load per body, none again
    with cluster.client() as client:
        ids = [b["id"] for b in cluster.warm_bodies()]
        client.sync(client.scheduler.broadcast, msg={"op": "gpu_end_warm", "bodies": ids})
