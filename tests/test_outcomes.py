"""The outcome stream's rules, without a server: what a flow process gets back, once each, and when it is gone."""

from __future__ import annotations

import asyncio
import time

import pytest

from aisched_prefect.control.http.app import _split_runs
from aisched_prefect.control.outcomes import OutcomeBook, result_digest
from aisched_prefect.flow.stream import CallStream
from aisched_prefect.wire import CallMeta, Reply, RunIn, RunsIn


def _reply(key: str, status: str = "completed") -> Reply:
    return Reply(status=status, key=key)


def test_each_outcome_is_delivered_until_acknowledged_and_never_after():
    book = OutcomeBook(lease_seconds=60)
    for k in ("a", "b", "c"):
        book.expect(k, "s1", "auth:team/p")
    book.put("a", _reply("a"), b"A")
    book.put("b", _reply("b"), b"B")

    async def scenario():
        first, pending = await book.take("s1", "auth:team/p", after=0, wait=0, max_bytes=2**20)
        assert [k.key for k in first] == ["a", "b"] and pending == 1
        again, _ = await book.take("s1", "auth:team/p", after=0, wait=0, max_bytes=2**20)  # the answer was lost
        assert [k.key for k in again] == ["a", "b"]
        acked, _ = await book.take("s1", "auth:team/p", after=first[-1].seq, wait=0, max_bytes=2**20)
        assert acked == []
        waiter = asyncio.ensure_future(book.take("s1", "auth:team/p", after=first[-1].seq, wait=5, max_bytes=2**20))
        await asyncio.sleep(0)
        book.put("c", _reply("c"), b"C")  # from a dispatch thread in the plane: wakes the long-poll
        got, pending = await asyncio.wait_for(waiter, 5)
        assert [(k.key, k.out) for k in got] == [("c", b"C")] and pending == 0

    asyncio.run(scenario())


def test_a_poll_is_bounded_in_bytes_but_always_makes_progress():
    book = OutcomeBook(lease_seconds=60)
    for k in ("a", "b"):
        book.expect(k, "s", "w")
        book.put(k, _reply(k), b"x" * 100)
    got, _ = asyncio.run(book.take("s", "w", after=0, wait=0, max_bytes=10))
    assert [k.key for k in got] == ["a"]  # one result larger than the bound still goes alone


def test_a_call_sent_again_finds_its_outcome_until_it_is_acknowledged():
    book = OutcomeBook(lease_seconds=60)
    book.expect("a", "s", "w")
    assert book.holds("s", "a")  # pending
    book.put("a", _reply("a"), b"A")
    assert book.holds("s", "a")  # ended, not acknowledged: a re-sent submit re-attaches
    got, _ = asyncio.run(book.take("s", "w", after=0, wait=0, max_bytes=2**20))
    asyncio.run(book.take("s", "w", after=got[-1].seq, wait=0, max_bytes=2**20))
    assert not book.holds("s", "a") and not book.holds("other", "a")


def test_a_session_belongs_to_the_principal_that_opened_it():
    book = OutcomeBook(lease_seconds=60)
    book.expect("a", "s", "auth:team-a/p")
    assert book.owns("s", "auth:team-a/p")
    assert not book.owns("s", "auth:team-b/p")
    assert book.owns("fresh", "auth:team-b/p")


def test_a_session_that_stops_polling_is_abandoned_with_what_it_still_waits_for():
    gone: list[list[str]] = []
    book = OutcomeBook(lease_seconds=0.0, on_abandoned=gone.append)
    for k in ("a", "b"):
        book.expect(k, "s", "w")
    book.put("a", _reply("a"), b"")
    assert sorted(book.expire()) == ["b"] and gone == [["b"]]
    book.put("b", _reply("b"), b"")  # it ends later: nobody waits, nothing is kept
    assert book.stats() == {"sessions": 0, "pending": 0, "unacknowledged": 0, "blocking": 0}


def test_a_flow_process_that_dies_after_a_poll_timed_out_is_abandoned_while_its_runs_still_run():
    """Its last long-poll ended with nothing to deliver, then the process died: once the lease lapses its waiting
    runs are given up, without waiting for one of its running runs to end first (they may run for hours, and the
    queue would start the waiting ones for nobody meanwhile)."""
    gone: list[list[str]] = []
    book = OutcomeBook(lease_seconds=0.05, on_abandoned=gone.append)
    for k in ("running", "waiting"):
        book.expect(k, "s", "w")
    asyncio.run(book.take("s", "w", after=0, wait=0.01, max_bytes=2**20))  # timed out: nothing ended
    assert book.expire() == []  # inside its lease
    deadline = time.monotonic() + 5
    while not gone and time.monotonic() < deadline:
        book.expire()
        time.sleep(0.01)
    assert gone and sorted(gone[0]) == ["running", "waiting"]


def test_a_session_with_a_poll_open_is_not_abandoned_and_its_lease_counts_from_the_poll_s_end():
    book = OutcomeBook(lease_seconds=0.05)
    book.expect("k", "s", "w")

    async def scenario():
        poll = asyncio.ensure_future(book.take("s", "w", after=0, wait=0.3, max_bytes=2**20))
        await asyncio.sleep(0.15)  # past the lease, but a poll is open: the flow process is there
        assert book.expire() == []
        assert await poll == ([], 1)
        assert book.expire() == []  # it was seen as its poll ended

    asyncio.run(scenario())


def test_a_session_whose_open_poll_was_just_woken_is_not_abandoned_before_the_poll_returns():
    """An outcome wakes a poll that waited past the lease; until the woken poll runs again (a loaded plane's loop may
    take seconds) the session has no waiter, but it was there until that moment: its other runs still wait for it."""
    book = OutcomeBook(lease_seconds=0.05)
    for k in ("done", "queued"):
        book.expect(k, "s", "w")
    loop = asyncio.new_event_loop()
    try:
        poll = loop.create_task(book.take("s", "w", after=0, wait=30, max_bytes=2**20))
        loop.run_until_complete(asyncio.sleep(0.01))  # the poll waits
        time.sleep(0.1)  # past the lease, the poll still open
        book.put("done", _reply("done"), b"D")  # wakes it; its loop has not run it again yet
        assert book.expire() == []  # "queued" is not taken out of the queue as abandoned
        got, pending = loop.run_until_complete(asyncio.wait_for(poll, 5))
        assert [k.key for k in got] == ["done"] and pending == 1
    finally:
        loop.close()


def test_a_blocking_caller_waits_for_its_own_call():
    book = OutcomeBook(lease_seconds=60)
    book.expect("k", None, "w")
    book.put("k", _reply("k", "failed"), b"err")
    assert book.wait_one("k", timeout=1) == (_reply("k", "failed"), b"err")


def _meta(i: int) -> CallMeta:
    return CallMeta(task_name="t", task_run_id=f"run-{i}", flow_run_id="f", run_key=f"f/{i}", request={},
                    code_digest="0" * 64)


def test_a_map_sends_its_function_once_and_each_call_gets_its_own_arguments():
    fn = b"FUNCTION"
    head = RunsIn(session="s" * 32, functions=[len(fn)],
                  calls=[RunIn(meta=_meta(i), function=0, args_length=len(f"args{i}")) for i in range(3)])
    calls = _split_runs(head, fn + b"args0args1args2")
    assert [(m.task_run_id, m.args_offset, body) for m, body in calls] == [
        (f"run-{i}", len(fn), (fn, f"args{i}".encode())) for i in range(3)]
    assert calls[0][1][0] is calls[2][1][0]  # one copy of the function for every waiting run


@pytest.mark.parametrize("blob, problem", [(b"FUNCTIONargs", "shorter"), (b"FUNCTIONargs0args1args2x", "longer")])
def test_a_runs_frame_that_does_not_add_up_is_refused(blob, problem):
    head = RunsIn(session="s" * 32, functions=[8],
                  calls=[RunIn(meta=_meta(i), function=0, args_length=5) for i in range(3)])
    with pytest.raises(ValueError, match=problem):
        _split_runs(head, blob)


def test_a_result_whose_bytes_differ_from_its_recorded_digest_is_never_unpickled():
    stream = CallStream(["http://127.0.0.1:9"], "token")

    async def scenario():
        loop = asyncio.get_running_loop()
        stream._waiting["k"] = fut = loop.create_future()
        stream._deliver("k", Reply(status="completed", key="k", result_digest=result_digest(b"good")), b"evil")
        reply, out = await fut
        assert reply.status == "failed" and "digest" in reply.error_message and out == b""
        stream._waiting["k2"] = fut2 = loop.create_future()
        stream._deliver("k2", Reply(status="completed", key="k2", result_digest=result_digest(b"good")), b"good")
        assert (await fut2)[1] == b"good"

    asyncio.run(scenario())


def test_a_resent_submit_told_done_takes_the_outcome_that_came_on_the_stream_meanwhile():
    """A submit whose answer was cut is sent again; meanwhile the run ended, its outcome came on this process's poll
    and was acknowledged, so the plane answers the resent submit "done, result lost". The flow has the outcome: it
    takes it (seen once under load in test_lifecycle's cut connections, as a task failed with ResultLost)."""
    stream = CallStream(["http://127.0.0.1:9"], "token")

    class Answer:
        def json(self):
            return {"replies": [Reply(status="failed", key="k1", error_type="aisched_prefect.ResultLost",
                                      error_message="lost with the connection").model_dump(mode="json")]}

    async def send(method, path, **kw):
        assert (method, path) == ("POST", "/v1/runs")
        stream._deliver("k1", Reply(status="completed", key="k1", result_digest=result_digest(b"value")), b"value")
        return 0, Answer()

    stream._send = send

    async def scenario():
        try:
            return await stream.call(_meta(1), b"fn", b"args")
        finally:
            await stream.aclose()

    reply, out = asyncio.run(scenario())
    assert (reply.status, out) == ("completed", b"value")
