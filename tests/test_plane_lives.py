"""A flow's outcome stream against a control plane that restarts, without a server: the plane is told apart by the
instance id it answers with, what it lost is sent again under the same keys, and a run it keeps losing fails named.

Why: a plane restarted within a poll's 20 s was taken for the one that accepted the calls; it answered `pending: 0`
for ever and a 1,000-run map waited 12 minutes with nothing sent again (issue 31).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from aisched_prefect.errors import RequestTooLarge, RunLost
from aisched_prefect.flow.following import Following
from aisched_prefect.flow.stream import CallStream
from aisched_prefect.wire import FRAME, CallMeta, OutcomeOut, OutcomesOut, Reply, RunsIn, frame, unframe


def _meta(i: int) -> CallMeta:
    return CallMeta(task_name="t", task_run_id=f"run-{i}", flow_run_id="f", run_key=f"f/{i}", request={},
                    code_digest="0" * 64)


class _Answer:
    def __init__(self, body: bytes = b"", data: object = None) -> None:
        self.content, self._data = body, data

    def json(self) -> object:
        return self._data


class FakePlane:
    """One replica as the flow sees it over HTTP: accepts calls into the life it is in, answers polls of that life.
    `restart()` is a new process: a new instance, no session, no outcomes; the calls it accepted are forgotten."""

    def __init__(self, limit: int = 2**30) -> None:
        self.limit = limit
        self.lives = 0
        self.submitted: list[str] = []  # every key a runs request carried (resends included)
        self.restart()
        self.finish_on_accept = True

    def restart(self) -> None:
        self.lives += 1
        self.instance = f"life-{self.lives}"
        self.pending: set[str] = set()
        self.ready: list[tuple[int, str]] = []
        self.seq = 0

    async def send(self, method: str, path: str, **kw: object) -> tuple[int, _Answer]:
        await asyncio.sleep(0)
        if path == "/v1/whoami":
            return 0, _Answer(data={"principal": "team/x", "max_call_bytes": self.limit})
        if path == "/v1/runs":
            head_bytes, _ = unframe(kw["content"])  # type: ignore[arg-type]
            head = RunsIn.model_validate_json(head_bytes)
            keys = [c.meta.task_run_id for c in head.calls]
            self.submitted += keys
            self.pending.update(keys)
            return 0, _Answer(data={"replies": [Reply(status="accepted", key=k).model_dump(mode="json") for k in keys],
                                    "instance": self.instance})
        assert path == "/v1/outcomes", path
        params = kw["params"]  # type: ignore[index]
        after = params["after"] if params["instance"] in ("", self.instance) else 0  # type: ignore[index]
        self.ready = [(s, k) for s, k in self.ready if s > after]
        if self.finish_on_accept:
            for key in sorted(self.pending):
                self.seq += 1
                self.ready.append((self.seq, key))
            self.pending.clear()
        outs = [OutcomeOut(key=k, seq=s, reply=Reply(status="completed", key=k), length=0) for s, k in self.ready]
        head = OutcomesOut(outcomes=outs, pending=len(self.pending), replica="r", instance=self.instance)
        return 0, _Answer(frame(head.model_dump_json().encode()))


def _run(stream: CallStream, n: int, timeout: float = 30) -> list[object]:
    async def scenario() -> list[object]:
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(stream.call(_meta(i), b"fn", b"args") for i in range(n)), return_exceptions=True), timeout)
        finally:
            await stream.aclose()

    return asyncio.run(scenario())


@pytest.mark.parametrize("when", ["before-first-poll", "after-a-poll"])
def test_calls_accepted_by_a_plane_that_restarted_are_sent_again_and_each_ends_once(when):
    """Restarted right after the map was accepted (before any poll answer: the case that hung), or after the flow
    had seen a poll answer: the new life answers with its own instance, so the stream sends what it had not seen
    end again, and every run ends once."""
    plane = FakePlane()
    plane.finish_on_accept = False
    stream = CallStream(["http://plane"], "token")
    stream._send = plane.send  # type: ignore[method-assign]
    polls = 0
    real_send = plane.send

    async def send(method: str, path: str, **kw: object) -> tuple[int, _Answer]:
        nonlocal polls
        if path == "/v1/outcomes":
            polls += 1
            if polls == (1 if when == "before-first-poll" else 2):
                plane.restart()  # killed and started again: it knows none of the calls
                plane.finish_on_accept = True
        return await real_send(method, path, **kw)

    stream._send = send  # type: ignore[method-assign]
    results = _run(stream, 20)
    assert all(isinstance(r, tuple) and r[0].status == "completed" for r in results), results
    assert sorted(r[0].key for r in results) == sorted(f"run-{i}" for i in range(20))  # type: ignore[union-attr]
    assert sorted(plane.submitted) == sorted([f"run-{i}" for i in range(20)] * 2)  # each sent again once


def test_a_plane_that_no_longer_counts_calls_it_accepted_gets_them_again():
    """Same instance, but its poll says fewer pending than this flow waits for there (its session expired while the
    flow was stalled): those calls are sent again; the plane re-attaches them by key."""
    plane = FakePlane()
    plane.finish_on_accept = False
    stream = CallStream(["http://plane"], "token")
    real_send = plane.send
    lost_once = False

    async def send(method: str, path: str, **kw: object) -> tuple[int, _Answer]:
        nonlocal lost_once
        if path == "/v1/outcomes" and not lost_once and plane.pending:
            lost_once = True
            plane.pending.clear()  # forgotten: `pending: 0`, nothing ready
            out = await real_send(method, path, **kw)
            plane.finish_on_accept = True
            return out
        return await real_send(method, path, **kw)

    stream._send = send  # type: ignore[method-assign]
    results = _run(stream, 5)
    assert all(isinstance(r, tuple) and r[0].status == "completed" for r in results), results
    assert len(plane.submitted) == 10


def test_a_plane_that_keeps_losing_a_run_fails_it_named_instead_of_waiting_for_ever():
    plane = FakePlane()
    plane.finish_on_accept = False
    stream = CallStream(["http://plane"], "token")
    real_send = plane.send

    async def send(method: str, path: str, **kw: object) -> tuple[int, _Answer]:
        if path == "/v1/outcomes":
            plane.restart()  # a crash loop: every poll meets a new life
            plane.finish_on_accept = False
        return await real_send(method, path, **kw)

    stream._send = send  # type: ignore[method-assign]
    started = time.monotonic()
    results = _run(stream, 3)
    assert all(isinstance(r, RunLost) for r in results), results
    assert "Fix: " in str(results[0]) and "restart" in str(results[0])
    assert time.monotonic() - started < 20
    assert len(plane.submitted) == 3 * (1 + stream._follow.most_resends)


def test_a_call_larger_than_the_plane_takes_fails_at_once_naming_the_setting():
    plane = FakePlane(limit=4096)
    stream = CallStream(["http://plane"], "token")
    stream._send = plane.send  # type: ignore[method-assign]

    async def scenario() -> None:
        try:
            with pytest.raises(RequestTooLarge, match="AISCHED_MAX_CALL_BYTES=4096") as caught:
                await stream.call(_meta(0), b"fn", b"x" * 5000)
            assert caught.value.setting == "AISCHED_MAX_CALL_BYTES"
            reply, _ = await stream.call(_meta(1), b"fn", b"x" * 100)  # a call under it goes as before
            assert reply.status == "completed"
        finally:
            await stream.aclose()

    asyncio.run(scenario())
    assert plane.submitted == ["run-1"]


def test_a_map_is_split_into_requests_the_plane_takes_whole():
    plane = FakePlane(limit=20_000)
    stream = CallStream(["http://plane"], "token")
    sizes: list[int] = []
    real_send = plane.send

    async def send(method: str, path: str, **kw: object) -> tuple[int, _Answer]:
        if path == "/v1/runs":
            sizes.append(len(kw["content"]))  # type: ignore[arg-type]
        return await real_send(method, path, **kw)

    stream._send = send  # type: ignore[method-assign]

    async def scenario() -> list[object]:
        try:
            return await asyncio.gather(*(stream.call(_meta(i), b"f" * 3000, b"a" * 3000) for i in range(12)))
        finally:
            await stream.aclose()

    results = asyncio.run(scenario())
    assert all(r[0].status == "completed" for r in results)
    assert len(sizes) > 1 and max(sizes) <= 20_000, sizes


def test_following_tells_a_new_life_and_calls_it_does_not_count():
    f = Following(most_resends=2)
    f.accepted(0, "a", "life-1")
    asked = time.monotonic() + 1
    assert f.answered(0, "life-1", pending=1, outcomes=0, asked_at=asked) == (False, set())
    assert f.answered(0, "life-2", pending=0, outcomes=0, asked_at=asked) == (True, {"a"})
    assert not f.waiting(0)
    f.accepted(0, "b", "life-2")  # accepted after the poll was sent: not counted yet is no loss
    assert f.answered(0, "life-2", pending=0, outcomes=0, asked_at=time.monotonic() - 60) == (False, set())
    assert [f.resend("b") for _ in range(3)] == [True, True, False]
